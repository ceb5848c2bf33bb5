"""Relaxations are bounds, applied only at the sampling they were validated at (lantern.plan.validated)."""
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from lantern.bundle import DEFAULT_BUNDLE, load_bundle
from lantern.decoding import SamplingConfig, method_preset
from lantern.embedded import quality_gate
from lantern.plan.choose import allowed_relaxation
from lantern.plan.validated import (Validation, bound_problems, describe_bound, guarded, k_limit, read_validations,
                                    relaxation_for, same_sampling, sampling_record)

REPO = Path(__file__).resolve().parents[2]
V = 1024
OWN = SamplingConfig(top_k=5, cfg_scale=3.0)  # the embedded bundle's
WHOLE = SamplingConfig(top_k=0, cfg_scale=4.0)  # LANTERN's class-to-image setting
SETTINGS = {"acceptance": "lantern", "k": 64, "delta": 0.2, "form": "bounded"}
AT_OWN = {"mc-sjd-relaxed": (Validation(SETTINGS, sampling_record(OWN)),)}


def test_the_bound_must_bound_something():
    nothing = method_preset("mc-sjd-relaxed", WHOLE, acceptance="lantern", k=1000, delta=1.0)  # the old default
    problems = bound_problems(nothing, V)
    assert len(problems) == 2 and "delta 1.0" in problems[0] and "allowed: delta <= 0.4" in problems[0]
    assert "k 1000" in problems[1] and f"allowed: k <= {k_limit(V)}" in problems[1]
    assert bound_problems(method_preset("mc-sjd-relaxed", WHOLE, **SETTINGS), V) == []
    assert k_limit(16384) >= 1000  # LANTERN's own k on LlamaGen's codebook stays allowed
    assert describe_bound(method_preset("lantern", OWN, k=64, delta=0.2), V) == (
        "each token's distribution moves by at most 0.2 in TV, only among each code's 64 nearest of 1024 codes")
    assert describe_bound(method_preset("mc-sjd", OWN), V).startswith("lossless")


def test_same_sampling_compares_the_support():
    rec = sampling_record(SamplingConfig(top_k=0, cfg_scale=4.0))
    assert same_sampling(rec, SamplingConfig(top_k=V, cfg_scale=4.0), V)  # 0 and V: the whole vocabulary
    assert same_sampling(rec, SamplingConfig(top_k=5000, cfg_scale=4.0), V)
    assert not same_sampling(rec, SamplingConfig(top_k=5, cfg_scale=4.0), V)
    assert not same_sampling(rec, SamplingConfig(top_k=0, cfg_scale=3.0), V)
    assert not same_sampling(rec, SamplingConfig(top_k=0, cfg_scale=4.0, greedy=True), V)


def test_applied_only_where_validated():
    here = relaxation_for("mc-sjd-relaxed", AT_OWN, OWN, V, allow_relaxed=False)
    assert here.settings == SETTINGS and "validated at this sampling" in here.why
    elsewhere = relaxation_for("mc-sjd-relaxed", AT_OWN, WHOLE, V, allow_relaxed=False)
    assert elsewhere.settings is None and "validated only at top_k 5" in elsewhere.why
    assert "--allow-relaxed" in elsewhere.why
    allowed = relaxation_for("mc-sjd-relaxed", AT_OWN, WHOLE, V, allow_relaxed=True)
    assert allowed.settings == SETTINGS and "not validated here" in allowed.why
    # auto: lossless at an unvalidated sampling, the validated plan where it was validated
    assert allowed_relaxation(False, AT_OWN, WHOLE, V)[0] == {}
    assert allowed_relaxation(False, AT_OWN, OWN, V)[0] == {"mc-sjd-relaxed": SETTINGS}
    # a preset relaxed on request keeps k within the codebook's limit
    preset = relaxation_for("lantern", {}, WHOLE, V, allow_relaxed=True)
    assert preset.settings == {"k": k_limit(V)} and "k 1000 clipped to 64 of 1024 codes" in preset.why


def test_old_entries_are_validated_nowhere_and_meaningless_ones_never_apply():
    old = read_validations({"lantern++": {"settings": {"k": 10, "lam": 2.0}, "evidence": {}}})
    r = relaxation_for("lantern++", old, OWN, V, allow_relaxed=False)
    assert r.settings is None and "records no sampling (treated as validated nowhere)" in r.why
    nothing = {"mc-sjd-relaxed": (Validation({"acceptance": "lantern", "k": 1000, "delta": 1.0},
                                             sampling_record(OWN)),)}
    r = relaxation_for("mc-sjd-relaxed", nothing, OWN, V, allow_relaxed=False)
    assert r.settings is None and "bound nothing" in r.why
    with pytest.raises(ValueError, match="relaxation_defaults\\['lantern'\\]: sampling"):
        read_validations({"lantern": [{"settings": {}, "sampling": {"top_k": 5}}]})


def test_named_method_falls_back_to_lossless_and_says_why():
    dcfg, info = guarded(method_preset("mc-sjd-relaxed", WHOLE), AT_OWN, V, allow_relaxed=False)
    assert dcfg.acceptance == "exact" and dcfg.drafting == "jacobi" and not info["applied"]
    assert info["allows"].startswith("lossless")
    dcfg, info = guarded(method_preset("mc-sjd-relaxed", OWN), AT_OWN, V, allow_relaxed=False)
    assert (dcfg.acceptance, dcfg.k, dcfg.delta) == ("lantern", 64, 0.2) and info["applied"]
    assert info["validated_at"] == sampling_record(OWN)
    dcfg, info = guarded(method_preset("lantern", WHOLE, delta=1.0, k=1000), {}, V, allow_relaxed=True)
    assert (dcfg.delta, dcfg.k) == (1.0, 1000) and "as given" in info["why"] and len(info["warnings"]) == 2
    assert guarded(method_preset("ar", WHOLE), AT_OWN, V, False)[1] is None


def test_settings_of_ones_own_run_as_given_only_where_allowed():
    """Settings other than the preset's are the caller's: relaxation allowed, they run as given; else they get
    what the preset would (the validated settings at this sampling, or lossless)."""
    own = method_preset("mc-sjd-relaxed", OWN, k=32, lam=2.0)
    assert guarded(own, AT_OWN, V, allow_relaxed=True)[0] == own
    validated = guarded(own, AT_OWN, V, allow_relaxed=False)[0]
    assert (validated.acceptance, validated.k, validated.delta, validated.window) == ("lantern", 64, 0.2, 16)
    assert guarded(replace(own, sampling=WHOLE), AT_OWN, V, allow_relaxed=False)[0].acceptance == "exact"
    # auto's relaxed tree of the lantern++ method, at its validated settings, runs as it is
    tree = method_preset("lantern++", OWN, drafting="chain-5", k=8, lam=2.0)
    assert guarded(tree, {"lantern++": (Validation({"k": 8, "lam": 2.0}, sampling_record(OWN)),)}, V,
                   allow_relaxed=False)[0] == tree
    for dcfg in (own, validated, tree):  # what runs, guarded again, runs unchanged
        for allowed in (False, True):
            once = guarded(dcfg, AT_OWN, V, allowed)[0]
            assert guarded(once, AT_OWN, V, allowed)[0] == once


CLI_RUN = ["generate", "--method", "mc-sjd-relaxed", "--top-k", "0"]


def library_and_cli_runs(flags: list, allow_relaxed: bool):
    """(the decode config Pipeline.generate ran for the bare preset at the flags' sampling, the CLI's for them)."""
    from lantern.api import Pipeline
    from lantern.cli import build_parser
    from lantern.cli.options import named_relaxation, sampling_from_args
    bundle = load_bundle()
    args = build_parser().parse_args([*CLI_RUN, *flags])
    preset = method_preset("mc-sjd-relaxed", sampling_from_args(args, bundle))
    pipe = Pipeline.from_bundle(bundle, backend="cpu")
    ran = pipe.generate([3], preset, tokens=2, **({"allow_relaxed": True} if allow_relaxed else {})).decode
    return ran, named_relaxation(args, bundle)[0]


def test_the_library_runs_an_unvalidated_relaxed_preset_lossless_as_the_cli_does():
    """CFG 7.5 over the whole vocabulary: the embedded bundle validated no relaxation there."""
    ran, cli = library_and_cli_runs(["--cfg-scale", "7.5"], allow_relaxed=False)
    assert ran.acceptance == "exact" and ran.drafting == "jacobi" and ran == cli


def test_the_library_runs_it_relaxed_when_allowed_as_the_cli_does():
    ran, cli = library_and_cli_runs(["--cfg-scale", "7.5", "--allow-relaxed"], allow_relaxed=True)
    assert ran.acceptance != "exact" and not bound_problems(ran, V) and ran == cli


def test_the_library_takes_the_validated_settings_where_the_bundle_has_them_as_the_cli_does():
    ran, cli = library_and_cli_runs(["--cfg-scale", "4.0"], allow_relaxed=False)
    validated = load_bundle().validations["mc-sjd-relaxed"]
    at_whole = next(v.settings for v in validated if v.sampling and same_sampling(v.sampling, WHOLE, V))
    assert {k: getattr(ran, k) for k in at_whole} == at_whole and ran == cli


def test_cli_named_method_relaxes_only_where_the_bundle_validated_it():
    """The embedded bundle validates relaxed MC-SJD at its own sampling and over the whole vocabulary at CFG 4.0
    (each with its own delta), not at CFG 7.5 (LANTERN's text-to-image guidance)."""
    from lantern.cli import build_parser
    from lantern.cli.options import named_relaxation
    bundle = load_bundle()
    parser = build_parser()
    sub = ["generate", "--method", "mc-sjd-relaxed", "--top-k", "0"]
    dcfg, info = named_relaxation(parser.parse_args([*sub, "--cfg-scale", "4.0"]), bundle)
    assert info["applied"] and info["validated_at"] == sampling_record(WHOLE) and dcfg.delta <= 0.4
    dcfg, info = named_relaxation(parser.parse_args([*sub, "--cfg-scale", "7.5"]), bundle)
    assert dcfg.acceptance == "exact" and not info["applied"] and "lossless" in info["why"]
    dcfg, info = named_relaxation(parser.parse_args([*sub, "--cfg-scale", "7.5", "--allow-relaxed"]), bundle)
    assert dcfg.acceptance != "exact" and info["applied"] and not bound_problems(dcfg, V)
    assert "not validated here" in info["why"]


def test_allow_relaxed_is_refused_for_lossless_methods(tmp_path, capsys):
    from lantern.cli import main
    assert main(["generate", "--method", "eagle2", "--allow-relaxed", "--out", str(tmp_path), "--json"]) == 2
    assert "--method eagle2 is lossless" in json.loads(capsys.readouterr().out)["error"]


def test_shipped_relaxations_passed_the_gate_by_the_results_they_cite():
    """Every relaxation the embedded bundle ships bounds something on its codebook, and the results file its
    evidence names shows it passing the gate, recomputed here rather than read from the manifest: the file's run
    of that method and settings at the validated sampling, against the limits recomputed from the file's own AR
    runs (quality_gate.Reference.of's margins), and a mean token TV within the setting's bound."""
    bundle = load_bundle()
    entries = json.loads((DEFAULT_BUNDLE / "manifest.json").read_text()).get("relaxation_defaults", {})
    vocab = bundle.target.config.vocab_size
    for method, validations in read_validations(entries).items():
        for v in validations:
            assert v.sampling is not None, method
            assert not bound_problems(method_preset(method, SamplingConfig(**v.sampling), **v.settings), vocab)
            results = json.loads((REPO / f"{v.evidence['results']}.json").read_text())
            assert same_sampling(results["sampling"], SamplingConfig(**v.sampling), vocab), (method, v.evidence)
            (row,) = [r for r in results["rows"] if r["method"] == method
                      and {k: r["overrides"].get(k) for k in v.settings} == v.settings]
            spread = results["ar_spread"]
            runs = results["ar"]  # AR's runs over seeds, each of the same images
            n, seeds = runs[0]["n"], len(runs)
            assert [r["class_accuracy"] for r in runs] == spread["accuracy_per_seed"] and seeds == spread["seeds"]
            assert [r["frechet_distance"] for r in runs] == spread["frechet_per_seed"]
            margin = quality_gate.Z * math.sqrt(1 + 1 / seeds)
            accuracy = statistics.fmean(r["class_accuracy"] for r in runs)  # pooled: every run has n images
            accuracy_limit = accuracy - margin * math.sqrt(max(accuracy * (1 - accuracy), 1 / n) / n)
            frechet_limit = spread["frechet_mean"] + margin * spread["frechet_sd"]  # (its partitions: not kept)
            assert spread["accuracy_limit"] == pytest.approx(accuracy_limit)
            assert spread["frechet_limit"] == pytest.approx(frechet_limit)
            tv_bound = quality_gate.token_tv_bound(v.settings.get("acceptance", method), v.settings.get("delta", 1.0),
                                                   v.settings["form"])
            assert row["n"] == n and row["class_accuracy"] >= accuracy_limit, (method, row)
            assert row["frechet_distance"] <= frechet_limit and row["token_tv_mean"] <= tv_bound, (method, row)
    defaults = bundle.relaxation_defaults  # what benchmarks at the bundle's own sampling run
    own = SamplingConfig(**bundle.default_sampling)
    assert all(any(v.sampling and same_sampling(v.sampling, own, vocab) for v in bundle.validations[m])
               for m in defaults)


def test_generate_where_nothing_was_validated_runs_the_relaxed_method_lossless(tmp_path, capsys):
    """The bundle validated no relaxation over the whole vocabulary at CFG 7.5: `--method mc-sjd-relaxed` runs
    MC-SJD's drafting with exact acceptance there, and the JSON says why."""
    from lantern.cli import main
    assert main(["generate", "--method", "mc-sjd-relaxed", "--top-k", "0", "--cfg-scale", "7.5", "--classes", "3",
                 "--no-images", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode"]["acceptance"] == "exact" and out["decode"]["drafting"] == "jacobi"
    assert out["relaxation"]["applied"] is False and out["relaxation"]["why"].startswith("lossless: not validated")
