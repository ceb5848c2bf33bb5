"""The embedded model: its digits data, evaluator and metrics, the quality gate, and the training that makes it
(and drafters for other bundles)."""
