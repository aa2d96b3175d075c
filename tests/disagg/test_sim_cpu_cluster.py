"""The simulator's model of hyla's own CPU cluster: colocated PD instances, measured step
costs (prefill overhead, decode context), engine-like chunking, a shared host CPU, and the
profile measured on the engine."""

import pytest
import simpy

from hyla.disagg.policy import RouterConfig
from hyla.disagg.sim.cpu import HostCPU
from hyla.disagg.sim.hardware import InstanceProfile, step_time
from hyla.disagg.sim.model import Deployment, Sim, SimConfig
from hyla.disagg.sim.profile import _fit_line, measure_engine_profile
from hyla.disagg.sim.workload import Request

PROFILE = {"name": "cpu", "prefill_tok_s": 10_000.0, "prefill_overhead_s": 0.005,
           "decode_step_s": {"1": 0.002, "16": 0.004}, "decode_context": 32,
           "decode_ctx_s": 1e-6}
MODEL_LAYERS = "GGGA"


def spec():
    from hyla.disagg.sim.hardware import ModelSpec

    return ModelSpec(name="tiny", total_params=2e5, active_params=2e5, weight_bytes=8e5,
                     kv_bytes_per_token=256, state_bytes=6144, attn_pair_flops=256,
                     linear_token_flops=6144, layers=MODEL_LAYERS)


def live_like(threshold=10_000, colocated=True):
    prof = InstanceProfile(gpu="H20", gpus=1, measured=PROFILE)
    return Deployment(name="cpu", kind="prfaas", local=prof, local_instances=1,
                      local_prefill=0, colocated=colocated, remote=prof, remote_instances=1,
                      policy=RouterConfig(threshold=threshold, adapt=False))


def cfg(**kw):
    base = dict(link_gbps=1.0, link_latency_s=0.0, max_num_seqs=16, block_size=16,
                prefill_chunk=1024, prefill_max_seqs=1, kv_blocks=4096)
    return SimConfig(**{**base, **kw})


def test_measured_step_prices_prefill_overhead_and_decode_context():
    prof = InstanceProfile(gpu="H20", gpus=1, measured=PROFILE)
    m = spec()
    assert step_time(prof, m, [(0, 100)], 0) == pytest.approx(0.005 + 0.01)
    assert step_time(prof, m, [(0, 50), (0, 50)], 0) == pytest.approx(0.015)  # one pass
    assert step_time(prof, m, [], [32]) == pytest.approx(0.002)
    # 1,000 tokens of context beyond the profiled 32 cost 1 us each
    assert step_time(prof, m, [], [1032]) == pytest.approx(0.003)


def test_host_cpu_shares_cores_fairly():
    env = simpy.Environment()
    cpu = HostCPU(env, cores=2)
    jobs = [cpu.work(1.0) for _ in range(3)]      # 3 jobs on 2 cores: each at 2/3 speed
    env.run(until=simpy.AllOf(env, jobs))
    assert env.now == pytest.approx(1.5)
    assert cpu.busy_core_s == pytest.approx(3.0)
    env2 = simpy.Environment()
    cpu2 = HostCPU(env2, cores=2)
    short, long_ = cpu2.work(0.5), cpu2.work(2.0)   # 2 jobs, 2 cores: no slowdown
    env2.run(until=short)
    assert env2.now == pytest.approx(0.5)
    env2.run(until=long_)
    assert env2.now == pytest.approx(2.0)
    with pytest.raises(ValueError, match="cores"):
        HostCPU(env, cores=0)


def test_colocated_pd_instance_prefills_and_decodes():
    reqs = [Request(rid=i, arrival=0.05 * i, prompt_len=100 + 40 * i, output_len=5)
            for i in range(12)]
    sim = Sim(spec(), live_like(), cfg())
    m = sim.run(reqs)
    assert m["completed"] == 12 and m["offload_fraction"] == 0
    assert m["busy"]["local_prefill"] is None and m["busy"]["decode"] > 0
    first = Request(rid=0, arrival=0.0, prompt_len=100, output_len=5)
    alone = Sim(spec(), live_like(), cfg()).run([first])
    # one prefill step (overhead + 100 tokens) samples the first token
    assert alone["ttft_p50_s"] == pytest.approx(0.005 + 0.01)
    with pytest.raises(ValueError, match="colocated"):
        Deployment(name="x", kind="prfaas", local=live_like().local, local_instances=2,
                   local_prefill=1, colocated=True, remote=live_like().local,
                   remote_instances=1)


def test_snapshot_interval_cuts_prefill_like_the_engine():
    req = [Request(rid=0, arrival=0.0, prompt_len=1536, output_len=2)]
    whole = Sim(spec(), live_like(), cfg()).run(req)["ttft_p50_s"]
    cut = Sim(spec(), live_like(), cfg(snapshot_interval=256)).run(req)["ttft_p50_s"]
    # the engine cuts 1,536 tokens at 256, 512, ..., 1,280 and the last full block (1,520):
    # 7 prefill steps instead of 2 (1,024-token budget), 5 more fixed costs
    assert cut - whole == pytest.approx(5 * 0.005, rel=0.05)


def test_request_latency_and_shared_host_cpu_slow_requests_down():
    reqs = [Request(rid=i, arrival=0.01 * i, prompt_len=300, output_len=8)
            for i in range(10)]
    base = Sim(spec(), live_like(), cfg()).run(reqs)
    late = Sim(spec(), live_like(), cfg(request_latency_s=0.02)).run(reqs)
    assert late["ttft_p50_s"] == pytest.approx(base["ttft_p50_s"] + 0.02, rel=1e-6)
    one_core = Sim(spec(), live_like(), cfg(host_cores=1, request_cpu_s=0.01,
                                                        token_cpu_s=0.001)).run(reqs)
    many = Sim(spec(), live_like(), cfg(host_cores=64, request_cpu_s=0.01,
                                                    token_cpu_s=0.001)).run(reqs)
    assert one_core["completed"] == many["completed"] == 10
    assert one_core["ttft_p50_s"] > many["ttft_p50_s"] > base["ttft_p50_s"]


def test_fit_line():
    assert _fit_line([(0, 1.0), (10, 2.0), (20, 3.0)]) == pytest.approx((1.0, 0.1))
    with pytest.raises(ValueError, match="two different"):
        _fit_line([(5, 1.0), (5, 2.0)])


def test_measure_engine_profile_on_the_debug_model():
    import torch

    from hyla.model import HylaLM, preset

    torch.manual_seed(0)
    prof = measure_engine_profile(HylaLM(preset("debug")).eval(), prompt_lens=(16, 64, 128),
                                  widths=(1, 2), repeats=2, decode_steps=3, long_context=64)
    assert prof["prefill_tok_s"] > 0 and prof["prefill_overhead_s"] >= 0
    assert set(prof["decode_step_s"]) == {"1", "2"}
    assert all(t > 0 for t in prof["decode_step_s"].values())
    assert prof["decode_ctx_s"] >= 0 and prof["decode_context"] == 32
    assert prof["engine"]["snapshot_interval"] == 256


def test_cli_profile_then_simulate_with_it(tmp_path):
    import json

    from hyla.cli import main

    prof = tmp_path / "cpu.json"
    assert main(["profile", "--preset", "debug", "--quick", "--json", str(prof)]) == 0
    data = json.loads(prof.read_text())
    assert data["preset"] == "debug" and data["prefill_tok_s"] > 0
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(prof), "--rate", "2", "--requests", "20",
                 "--threshold", "512", "--homo-prefill", "4", "--prfaas-prefill", "2",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["profile"] == str(prof) and res["model"]["layers"] == "GGGA"
    assert all(m["completed"] == 20 for m in res["deployments"].values())
    del data["preset"]
    prof.write_text(json.dumps(data))
    assert main(["simulate", "--profile", str(prof), "--rate", "2"]) == 2
