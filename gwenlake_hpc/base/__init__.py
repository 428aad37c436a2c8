"""Basics: exceptions with exit statuses (``errors``), the rules settings follow (``rules``), the rules for names
users give (``names``) and durable writes (``fsutil``). Imports nothing else of the package."""
