"""The device-free decoding core: sampling, trees, drafting, acceptance (the step that uses them:
lantern.engine)."""
from lantern.decoding.acceptance import Acceptance
from lantern.decoding.config import METHODS, DecodeConfig, method_preset
from lantern.decoding.sampling import SamplingConfig
from lantern.decoding.stats import GenerationStats
from lantern.decoding.trees import TREE_PRESETS, compile_tree, load_tree

__all__ = ["Acceptance", "METHODS", "DecodeConfig", "method_preset", "SamplingConfig", "GenerationStats",
           "TREE_PRESETS", "compile_tree", "load_tree"]
