"""Accuracy harness: synthetic long-context tasks (tasks.py), their metrics (scoring.py), reports."""
