"""Tests through a real front end: JupyterLab driven in headless Chromium (tests/support/jupyterlab.py)."""
