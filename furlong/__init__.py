"""furlong: RL post-training for LLMs whose whole production topology runs on a laptop CPU."""

__version__ = "0.1.0"
