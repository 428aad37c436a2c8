"""Bring your own trainer: a framework's own training loop driven as the Run's loop.

- :mod:`.transformers`: the Hugging Face ``Trainer`` (``pip install gwenlake_hpc[transformers]``);
- :mod:`.lightning`: a Lightning ``Trainer`` (``pip install gwenlake_hpc[lightning]``);
- :mod:`.loop`: what both share, the Run's loop advanced from a framework's callbacks, one optimizer step a step.

Nothing here is imported by ``import gwenlake_hpc``: each module imports its framework when it is imported.
"""
