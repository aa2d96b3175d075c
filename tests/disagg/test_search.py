"""Issue 18: the policy's long-timescale search (t = 0 and t = infinity included), the
bounded short-timescale controller, and capacity as a monotone, repeatable search."""

import dataclasses
import math

import pytest

from hyla.disagg.policy import ALL_LOCAL, PrfaasRouter, RouterConfig
from hyla.disagg.sim.capacity import compare_capacity
from hyla.disagg.sim.hardware import InstanceProfile, published_1t_hybrid
from hyla.disagg.sim.model import Deployment, Sim, SimConfig
from hyla.disagg.sim.search import (
    Choice,
    interval,
    offload_thresholds,
    prfaas_space,
    tournament,
)
from hyla.disagg.sim.setups import workload_maker
from hyla.disagg.sim.workload import SyntheticMix

MODEL = published_1t_hybrid()


def small_deps(threshold=19_400, prefill=1):
    h20, h200 = InstanceProfile(gpu="H20"), InstanceProfile(gpu="H200")
    return {
        "homogeneous": Deployment(name="homogeneous", kind="homogeneous", local=h20,
                                  local_instances=3, local_prefill=2),
        "naive": Deployment(name="naive", kind="naive", local=h20, local_instances=2,
                            local_prefill=0, remote=h200, remote_instances=1),
        "prfaas": Deployment(name="prfaas", kind="prfaas", local=h20, local_instances=3,
                             local_prefill=prefill, remote=h200, remote_instances=1,
                             policy=RouterConfig(threshold=threshold)),
    }


def test_controller_stays_in_its_band_and_returns_within_its_reaction_time():
    cfg = RouterConfig(threshold=8_000, band=2.0, step=1.15)
    r = PrfaasRouter(cfg)
    for i in range(50):                       # a long busy spell: t rises, but only to the band
        r.observe(i, link_util=0.95)
    assert r.t == 16_000
    for i in range(cfg.reaction_steps):       # signal gone: back at the anchor in time
        r.observe(100 + i, link_util=0.2)
    assert r.t == 8_000
    for i in range(50):
        r.observe(200 + i, link_util=0.1, local_queue_s=50.0)
    assert r.t == 4_000
    assert cfg.reaction_steps == math.ceil(math.log(2) / math.log(1.15))


@pytest.mark.parametrize("t,target", [(0, "remote"), (ALL_LOCAL, "local")],
                         ids=["all-remote", "all-local"])
def test_endpoints_are_fixed_points_of_the_controller(t, target):
    r = PrfaasRouter(RouterConfig(threshold=t))
    for i in range(30):
        r.observe(i, link_util=0.95 if i % 2 else 0.0, local_queue_s=0.0 if i % 2 else 40.0)
        assert r.route(1 if t == 0 else 900_000).target == target
    assert r.t == t


def test_tournament_is_monotone_repeatable_and_keeps_pinned():
    caps = {"a": 2.0, "b": 5.0, "c": 3.3}

    def cfg(cap):
        return lambda rate: {"slo_attainment": 1.0 if rate <= cap else 0.2, "ttft_p90_s": 1.0}
    configs = {k: cfg(v) for k, v in caps.items()}
    res = tournament(configs, start=1.0, rel_tol=0.01)
    assert res["choice"] == "b" and 5.0 / 1.01 <= res["capacity"] <= 5.0
    assert res == tournament(configs, start=1.0, rel_tol=0.01)
    # from above: bracketing down; the pinned config survives the pruning
    res = tournament(configs, start=40.0, rel_tol=0.01, keep=1, pinned=("a",))
    assert res["choice"] == "b" or res["capacity"] >= 2.0 / 1.01
    assert tournament({"x": cfg(0.0)}, start=1.0)["capacity"] == 0.0
    # one rate grid whatever the start: searches from different starts give one figure
    for cap in (0.37, 3.3, 41.0):
        got = {tournament({"x": cfg(cap)}, start=s, rel_tol=0.02)["capacity"]
               for s in (0.05, 0.9, 3.0, 7.7, 300.0)}
        assert len(got) == 1 and cap / 1.02 <= got.pop() <= cap


def test_interval_and_thresholds():
    iv = interval([1.0, 1.0, 1.0])
    assert iv["mean"] == 1.0 and iv["half"] == 0.0
    iv = interval([0.9, 1.0, 1.1, 1.0, 1.0])
    assert iv["lo"] < 1.0 < iv["hi"] and iv["rel_half"] == pytest.approx(iv["half"])
    reqs = SyntheticMix(prompt_median=2000, followup=0.0).generate(200, 1.0)
    ts = offload_thresholds(reqs, (0.1, 0.5))
    assert ts[0] > ts[1]
    assert sum(r.prompt_len > ts[1] for r in reqs) == pytest.approx(100, abs=15)
    space = prfaas_space(small_deps()["prfaas"], reqs, fractions=(0.5,))
    assert Choice(0, 0) in space and Choice(ALL_LOCAL, 1) in space
    assert {c.family for c in space} == {"all remote", "all local", "threshold"}


def test_stop_below_gives_the_full_runs_verdict():
    dep = small_deps()["homogeneous"]
    reqs = SyntheticMix(prompt_median=8000, followup=0.0, output_median=16).generate(60, 3.0)
    full = Sim(MODEL, dep, SimConfig()).run(reqs)
    early = Sim(MODEL, dep, SimConfig()).run(reqs, stop_below=0.9)
    assert full["slo_attainment"] < 0.9 and early["stopped_early"]
    assert early["slo_attainment"] < 0.9 and early["sim_seconds"] < full["sim_seconds"]


def test_held_out_symptom_short_prompts_search_never_below_naive():
    """Short prompts (code-completion-like) with a threshold tuned for 28K prompts: as
    configured nothing is offloaded and it loses to naive; the searched policy does not."""
    deps = small_deps(threshold=19_400, prefill=1)
    mix = SyntheticMix(prompt_median=1500, prompt_sigma=0.9, followup=0.0, output_median=13)

    def make_seed(seed):
        return workload_maker(mix=mix, num_requests=40, seed=seed, min_duration_s=10)
    res = compare_capacity(MODEL, deps, make_seed, [0], rel_tol=0.05, fractions=(0.5,))
    p = res["deployments"]["prfaas"]
    naive = res["deployments"]["naive"]["capacity"]["mean"]
    assert p["capacity"]["mean"] >= naive
    assert p["alternatives"]["configured"]["mean"] < naive     # the symptom
    # t = 0 is naive's routing, searched on the same rate grid: the same figure exactly
    assert p["alternatives"]["all remote"]["mean"] == naive
    again = compare_capacity(MODEL, deps, make_seed, [0], rel_tol=0.05, fractions=(0.5,))
    # repeatable: the same seeds give the same figures
    assert again["deployments"]["prfaas"]["capacity"]["values"] == p["capacity"]["values"]



def test_search_false_takes_every_deployment_as_configured():
    """``search=False`` (disagg_variance's fixed configurations): no split or threshold
    searched. A local function named ``search`` once shadowed the flag, so every call
    searched."""
    deps = small_deps(threshold=19_400, prefill=1)
    mix = SyntheticMix(prompt_median=1500, prompt_sigma=0.9, followup=0.0, output_median=13)

    def make_seed(seed):
        return workload_maker(mix=mix, num_requests=30, seed=seed, min_duration_s=10)
    res = compare_capacity(MODEL, deps, make_seed, [0], rel_tol=0.05, search=False)
    p = res["deployments"]["prfaas"]
    assert set(p["alternatives"]) == {"configured"}
    assert p["per_seed"][0]["family"] == "configured"
    assert res["deployments"]["homogeneous"]["choice"] == ["as configured"]

def test_screening_keeps_every_family_and_never_ends_below_naive():
    """Two-stage search: all configurations on short runs, the finalists of each family on
    full ones; t = 0 always reaches the second stage, so PrfaaS >= naive still holds."""
    deps = small_deps(threshold=19_400, prefill=1)
    mix = SyntheticMix(prompt_median=6000, followup=0.0, output_median=13)

    def make(n):
        return lambda seed: workload_maker(mix=mix, num_requests=n, seed=seed,
                                           min_duration_s=n / 4)
    kw = dict(rel_tol=0.05, fractions=(0.25, 0.5), configured=False)
    full = compare_capacity(MODEL, deps, make(60), [0], **kw)
    screened = compare_capacity(MODEL, deps, make(60), [0], screen_seed=make(20),
                                finalists=1, **kw)
    p, naive = screened["deployments"]["prfaas"], screened["deployments"]["naive"]
    assert set(p["alternatives"]) == {"all remote", "all local", "threshold"}
    assert p["alternatives"]["all remote"]["mean"] == naive["capacity"]["mean"]
    assert p["capacity"]["mean"] >= naive["capacity"]["mean"]
    # full runs of fewer configurations: fewer runs, and the answer of the exhaustive
    # search within a grid step or two
    runs = sum(r["runs"] for r in p["per_seed"])
    assert runs < sum(r["runs"] for r in full["deployments"]["prfaas"]["per_seed"])
    assert p["capacity"]["mean"] >= full["deployments"]["prfaas"]["capacity"]["mean"] / 1.11


def test_workload_maker_min_duration_extends_and_keeps_the_prefix():
    make = workload_maker(num_requests=20, min_duration_s=30, seed=3)
    a, b = make(0.5), make(2.0)
    assert len(a) == 20 and len(b) == 60
    assert [r.prompt_len for r in b[:20]] == [r.prompt_len for r in a]
    t1 = workload_maker(trace="azure-conv", num_requests=10, seed=1, arrivals="poisson")(1.0)
    t0 = workload_maker(trace="azure-conv", num_requests=10, seed=0, arrivals="poisson")(1.0)
    assert [r.prompt_len for r in t1] != [r.prompt_len for r in t0]
    assert dataclasses.asdict(t0[0])["rid"] == 0


def test_cli_capacity_shows_the_choice_beside_the_alternatives(tmp_path, capsys,
                                                               monkeypatch):
    import json

    from hyla.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "cap.json"
    assert main(["simulate", "--trace", "azure-conv", "--length-scale", "8", "--requests",
                 "20", "--seeds", "2", "--min-duration", "5", "--rel-tol", "0.1",
                 "--deployments", "naive,prfaas", "--offload", "0.5", "--json", str(out)]) == 0
    assert main(["simulate", "--offload", "2", "--requests", "10"]) == 2
    text = capsys.readouterr().out
    for word in ("policy's choice", "all remote", "all local", "threshold", "configured",
                 "prfaas vs naive", "+-"):
        assert word in text
    res = json.loads(out.read_text())
    r = res["ratios"]["prfaas_vs_naive"]
    assert r["n"] == 2 and r["lo"] <= r["mean"] <= r["hi"] and r["mean"] >= 1.0 - 1e-9
    assert set(res["deployments"]["prfaas"]["alternatives"]) == {
        "all remote", "all local", "threshold", "configured"}


def test_cli_fits_the_h200_mfu_and_refuses_bad_search_flags(tmp_path, capsys, monkeypatch):
    import json

    from hyla.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "fit.json"
    assert main(["simulate", "--trace", "azure-conv", "--length-scale", "8", "--requests",
                 "20", "--screen-requests", "10", "--seeds", "2", "--min-duration", "5",
                 "--rel-tol", "0.1", "--deployments", "homogeneous,naive",
                 "--fit-h200-mfu", "1.16", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    c = res["calibration"]
    assert res["h200_mfu"] == c["remote_mfu"] and 0.05 < c["remote_mfu"] < 0.45
    assert c["target"] == 1.16 and len(c["steps"]) == 6 and c["ratio"]["n"] == 2
    assert res["search"] == {"requests": 20, "min_duration_s": 5.0, "screen_requests": 10,
                             "stratify": None}
    assert "fitted H200 prefill MFU" in capsys.readouterr().out
    for bad, word in ((["--screen-requests", "3"], "--screen-requests"),
                      (["--fit-h200-mfu", "1.2", "--rate", "1"], "--fit-h200-mfu"),
                      (["--fit-h200-mfu", "1.2", "--deployments", "naive,prfaas"],
                       "--fit-h200-mfu"),
                      (["--fit-h200-mfu", "-1"], "--fit-h200-mfu"),
                      # a newcomer's: NaN from inf, the threshold named by its deployments,
                      # a binary file's decode error
                      (["--rate", "inf"], "finite"),
                      (["--threshold", "-5", "--no-search"], "--threshold")):
        assert main(["simulate", "--requests", "10", *bad]) == 2
        assert word in capsys.readouterr().err
    blob = tmp_path / "model.gguf"
    blob.write_bytes(b"GGUF\x8e\xff\x00" * 100)
    assert main(["simulate", "--requests", "10", "--profile", str(blob)]) == 2
    assert "is not JSON" in capsys.readouterr().err
