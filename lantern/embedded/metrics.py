"""Sample-quality metrics in the evaluator's feature space (lantern's stand-in for FID; docs/algorithms.md, 7)."""
from __future__ import annotations

import numpy as np


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to two feature sets (N_a, d), (N_b, d):
    |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)).

    tr((S_a S_b)^(1/2)) is computed as the sum of sqrt of the eigenvalues of S_a^(1/2) S_b S_a^(1/2), which is
    symmetric PSD, so no complex sqrtm and no blow-up when a covariance is singular (few samples, d large).
    """
    a, b = np.asarray(feats_a, dtype=np.float64), np.asarray(feats_b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"feature sets of shapes {a.shape} and {b.shape}; expected (N_a, d) and (N_b, d)")
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"need >= 2 samples per set for a covariance, got {len(a)} and {len(b)}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T  # S_a^(1/2)
    m = root_a @ s_b @ root_a
    tr_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * tr_sqrt)


def class_accuracy(predicted: np.ndarray, requested: np.ndarray) -> float:
    """Fraction of samples the evaluator assigns to the class they were generated for."""
    predicted, requested = np.asarray(predicted), np.asarray(requested)
    if predicted.shape != requested.shape:
        raise ValueError(f"predicted {predicted.shape} and requested {requested.shape} labels differ in shape")
    return float((predicted == requested).mean())
