"""The PrfaaS simulator: cost model, workloads, one run per deployment kind, the CLI."""

import dataclasses
import json

import pytest

from hyla.disagg.sim.hardware import (
    InstanceProfile,
    load_measured_profile,
    published_1t_hybrid,
    step_time,
)
from hyla.disagg.sim.kv_table import kv_table
from hyla.disagg.sim.model import Deployment, Sim, SimConfig
from hyla.disagg.sim.setups import published_deployments, workload_maker
from hyla.disagg.sim.traces import TRACES, list_traces, trace_path
from hyla.disagg.sim.workload import SyntheticMix, arrival_times, load_trace

MODEL = published_1t_hybrid()


@pytest.fixture(scope="module")
def trace() -> str:
    """The Azure conversation trace that ships with hyla, by path (names work too)."""
    return str(trace_path("azure-conv"))


def small_deps():
    h20, h200 = InstanceProfile(gpu="H20"), InstanceProfile(gpu="H200")
    return {
        "homogeneous": Deployment(name="homogeneous", kind="homogeneous", local=h20,
                                  local_instances=3, local_prefill=2),
        "naive": Deployment(name="naive", kind="naive", local=h20, local_instances=2,
                            local_prefill=0, remote=h200, remote_instances=1),
        "prfaas": Deployment(name="prfaas", kind="prfaas", local=h20, local_instances=2,
                             local_prefill=1, remote=h200, remote_instances=1),
    }


def test_step_time_roofline():
    h20, h200 = InstanceProfile(gpu="H20"), InstanceProfile(gpu="H200")
    pre20 = step_time(h20, MODEL, [(0, 8192)], 0)
    pre200 = step_time(h200, MODEL, [(0, 8192)], 0)
    assert 5 < pre20 / pre200 < 7            # compute-bound: the FLOP/s ratio 989 / 148
    # attention makes a later chunk of the same prompt cost more
    assert step_time(h200, MODEL, [(24_576, 8192)], 0) > pre200
    d1 = step_time(h20, MODEL, [], [1000])
    d64 = step_time(h20, MODEL, [], [1000] * 64)
    assert d1 < d64 < 64 * d1                # batching amortises the weights
    assert step_time(h20, MODEL, [], []) == 0.0


def test_measured_profile(tmp_path):
    p = tmp_path / "serve_profile.json"
    p.write_text(json.dumps({"name": "cpu", "prefill_tok_s": 1000.0,
                             "decode_step_s": {"1": 0.01, "8": 0.03}}))
    prof = load_measured_profile(p)
    assert step_time(prof, MODEL, [(0, 500)], 0) == pytest.approx(0.5)
    assert step_time(prof, MODEL, [], [10] * 4) == pytest.approx(0.01 + 0.02 * 3 / 7)
    assert step_time(prof, MODEL, [], [10] * 16) == pytest.approx(0.06)
    p.write_text("{}")
    with pytest.raises(ValueError, match="prefill_tok_s"):
        load_measured_profile(p)


def test_kv_table_hybrids_emit_less():
    rows = {r["mix"]: r for r in kv_table(include_hyla=False)}
    assert 30 < rows["dense (GQA)"]["kv_gbps"] < 60        # published dense: 33-60 Gbps
    assert 2 < rows["7:1 hybrid"]["kv_gbps"] < 4.5          # published 1T hybrid: 3.19
    assert rows["dense (GQA)"]["kv_gbps"] > 10 * rows["7:1 hybrid"]["kv_gbps"]
    assert rows["3:1 hybrid"]["kv_gbps"] > rows["7:1 hybrid"]["kv_gbps"]


def test_workloads(trace):
    reqs = load_trace(trace, length_scale=8, rate=2.0, num_requests=50)
    raw = load_trace(trace, num_requests=50)
    assert [r.prompt_len for r in reqs] == [r.prompt_len * 8 for r in raw]
    assert (len(reqs) - 1) / reqs[-1].arrival == pytest.approx(2.0)
    g = load_trace(trace, rate=1.0, arrivals="gamma", num_requests=20)
    assert g[0].arrival == 0.0 and len(g) == 20
    mix = SyntheticMix().generate(300, 4.0, seed=1)
    follow = [r for r in mix if r.prefix_len]
    assert follow and all(r.prefix_len < r.prompt_len for r in follow)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="neither a built-in trace"):
        load_trace("/nonexistent.csv")


def test_built_in_traces_ship_with_the_package_and_load_by_name():
    # package data, with their provenance and licence beside them
    assert "MIT License" in (trace_path("azure-conv").parent / "README.md").read_text()
    summary = {t["name"]: t for t in list_traces()}
    assert set(summary) == set(TRACES)
    conv, arxiv = summary["azure-conv"], summary["arxiv-summarization"]
    assert (conv["requests"], conv["prompt_p50"], conv["arrivals"]) == (19_366, 1_020, True)
    assert (arxiv["requests"], arxiv["prompt_p50"], arxiv["arrivals"]) == (28_257, 2_730, False)
    by_name = load_trace("azure-conv", num_requests=5)
    assert by_name == load_trace(trace_path("azure-conv"), num_requests=5)
    with pytest.raises(ValueError, match="give a rate"):
        load_trace("arxiv-summarization", num_requests=5)
    assert len(load_trace("arxiv-summarization", rate=2.0, num_requests=5)) == 5


def test_cli_simulate_takes_a_trace_name_and_lists_them(tmp_path, capsys):
    from hyla.cli import main

    assert main(["simulate", "--list-traces"]) == 0
    listed = capsys.readouterr().out
    assert "azure-conv" in listed and "arxiv-summarization" in listed and "1,020" in listed
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", "arxiv-summarization", "--rate", "0.5", "--requests",
                 "10", "--deployments", "naive", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["workload"]["trace"] == "arxiv-summarization"
    assert main(["simulate", "--trace", "nope", "--rate", "1"]) == 2
    assert "neither a built-in trace" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["homogeneous", "naive", "prfaas"])
def test_run_each_deployment(kind):
    reqs = SyntheticMix().generate(40, 0.3, seed=2)
    m = Sim(MODEL, small_deps()[kind], SimConfig()).run(reqs)
    assert m["completed"] == 40
    assert m["ttft_p50_s"] > 0 and m["tpot_p50_s"] > 0 and m["throughput_tok_s"] > 0
    assert m["ttft_p90_s"] >= m["ttft_p50_s"]
    if kind == "homogeneous":
        assert m["offload_fraction"] == 0 and m["egress_gbps"] == 0
    elif kind == "naive":
        assert m["offload_fraction"] == 1 and 0 < m["egress_gbps"] < 100
    else:
        assert 0 < m["offload_fraction"] < 1 and m["threshold_final"] is not None
        assert m["recommended_local_prefill"] in (1,)


def test_prfaas_offloads_only_long_incremental_prefills():
    reqs = SyntheticMix().generate(40, 0.3, seed=3)
    dep = small_deps()["prfaas"]
    sim = Sim(MODEL, Deployment(**{**dep.__dict__,
                                   "policy": dataclasses.replace(dep.policy, adapt=False)}))
    sim.run(reqs)
    for rec in sim.rec.values():
        assert (rec["cluster"] == "remote") == (rec["incremental"] > dep.policy.threshold) or \
            rec["cached"] > 0   # cache-aware placement may count a prefix held elsewhere


def test_deployment_validation():
    with pytest.raises(ValueError, match="remote"):
        Deployment(name="x", kind="naive", local=InstanceProfile(gpu="H20"),
                   local_instances=2, local_prefill=0)
    with pytest.raises(ValueError, match="decode instance"):
        Deployment(name="x", kind="homogeneous", local=InstanceProfile(gpu="H20"),
                   local_instances=2, local_prefill=2)
    assert sum(d.gpus() for d in published_deployments().values()) == 3 * 96


def test_cli_simulate_json(tmp_path, capsys, trace):
    from hyla.cli import main

    out = tmp_path / "sim.json"
    code = main(["simulate", "--setup", "published", "--trace", trace, "--length-scale", "4",
                 "--rate", "1.0", "--requests", "30", "--json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    assert set(res["deployments"]) == {"homogeneous", "naive", "prfaas"}
    for m in res["deployments"].values():
        for key in ("throughput_tok_s", "goodput_req_s", "ttft_p50_s", "ttft_p90_s",
                    "egress_gbps"):
            assert isinstance(m[key], float)
    assert "prfaas_vs_naive" in res["ratios"] and res["h200_mfu"] == 0.45
    slow = tmp_path / "slow.json"
    assert main(["simulate", "--trace", trace, "--length-scale", "4", "--rate", "1.0",
                 "--requests", "30", "--deployments", "naive", "--h200-mfu", "0.2",
                 "--json", str(slow)]) == 0
    naive = res["deployments"]["naive"]["ttft_p50_s"]
    assert json.loads(slow.read_text())["deployments"]["naive"]["ttft_p50_s"] > naive
    assert main(["simulate", "--deployments", "nope", "--rate", "1"]) == 2
    assert main(["simulate", "--h200-mfu", "1.5", "--rate", "1"]) == 2
    assert main(["kv-table"]) == 0


def test_workload_maker_is_rate_independent():
    make = workload_maker(num_requests=20)
    a, b = make(1.0), make(2.0)
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
    assert b[-1].arrival < a[-1].arrival


def test_fit_remote_mfu_bisects_toward_the_target_ratio():
    from hyla.disagg.sim.capacity import fit_remote_mfu

    mix = SyntheticMix(prompt_median=4000, followup=0.0, output_median=8)
    deps = small_deps()
    res = fit_remote_mfu(MODEL, deps, lambda seed: workload_maker(
        mix=mix, num_requests=20, seed=seed), [0, 1], target=1.0, iters=3, rel_tol=0.1)
    assert len(res["steps"]) == 3 and res["homogeneous"]["mean"] > 0
    assert res["homogeneous"]["n"] == 2 and res["ratio"]["n"] == 2
    first, second = res["steps"][:2]
    assert first["remote_mfu"] == pytest.approx((0.05 + 0.45) / 2)
    # bisection: a ratio above the target lowers the MFU tried next, one below raises it
    assert (second["remote_mfu"] < first["remote_mfu"]) == (first["ratio"]["mean"] > 1.0)
    assert res["remote_mfu"] in [s["remote_mfu"] for s in res["steps"]]
    with pytest.raises(ValueError, match="lo < hi"):
        fit_remote_mfu(MODEL, deps, None, [0], target=1.0, lo=0.5, hi=0.4)


def test_synthetic_mix_stratified_blocks():
    mix = SyntheticMix(followup=0.25)
    a, b = mix.generate(250, 1.0, seed=3), mix.generate(400, 1.0, seed=3)
    # fixed-size blocks: more requests leave the first ones as they were
    assert [(r.prompt_len, r.output_len, r.prefix_len) for r in a] == \
        [(r.prompt_len, r.output_len, r.prefix_len) for r in b[:250]]
    # a block of 100 follow-up choices says "follow up" exactly 25 times (stratified; a
    # follow-up whose context would pass max_len becomes a fresh request), where
    # independent draws spread over about 17-33
    for seed in range(5):
        reqs = SyntheticMix(followup=0.25).generate(201, 1.0, seed=seed)
        assert 20 <= sum(r.prefix_len > 0 for r in reqs[1:101]) <= 25
    # the mean of 100 stratified prompt lengths varies less over seeds than independent ones
    import statistics

    def spread(block):
        m = SyntheticMix(followup=0.0, stratify=block)
        return statistics.pstdev(statistics.mean(r.prompt_len for r in m.generate(100, 1.0,
                                                                                  seed=s))
                                 for s in range(20))
    assert spread(100) < 0.3 * spread(1)
