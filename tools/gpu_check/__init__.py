"""Checks that need an accelerator; run by hand on a GPU host (see README.md here)."""
