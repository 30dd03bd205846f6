"""Accuracy harness: synthetic long-context tasks (tasks.py), their metrics (scoring.py), summaries,
tables and heat maps (report.py). launch/eval.py drives an engine through them."""
from starshard.evaluation.scoring import METRICS, score
from starshard.evaluation.tasks import TASKS, Sample, TaskSpec, make_sample, make_samples

__all__ = ["METRICS", "TASKS", "Sample", "TaskSpec", "make_sample", "make_samples", "score"]
