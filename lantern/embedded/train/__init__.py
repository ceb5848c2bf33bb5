"""Training pipeline for the embedded default bundle: tokenizer -> target -> drafter, plus the evaluator."""
