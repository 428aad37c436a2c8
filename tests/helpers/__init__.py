"""Helpers shared by the tests (a package: tests/conftest.py puts tests/ on sys.path)."""
