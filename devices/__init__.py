"""Backends. Each implements the same contract (devices/base.py) and never imports edge/."""
