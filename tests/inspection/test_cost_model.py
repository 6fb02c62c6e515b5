"""The topology cost model (hlo_tools.inspection.cost_model) and `hlo-tools cost`: formulas, algorithms, CLI."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

import hlo_tools
from hlo_tools import cli
from hlo_tools.inspection import cost_model
from hlo_tools.inspection.cost_model import Chip, collective_time, plan_collective
from hlo_tools.inspection.topology import Topology

# Powers of two, so that every formula below holds to the last bit.
BANDWIDTH, LATENCY = 2.0 ** 30, 2.0 ** -20
CHIP = Chip("test", peak_flops=2.0 ** 40, hbm_bandwidth=2.0 ** 36, link_bandwidth=BANDWIDTH,
            link_latency=LATENCY)
MB = 2 ** 20

ADD = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}
"""


def all_reduce_module(replicas: int) -> hlo_tools.HloModule:
    """All replicas sum a 4 MiB gradient."""
    return hlo_tools.parse_module(f"""HloModule ar, replica_count={replicas}
{ADD}
ENTRY main {{
  p = f32[1048576] parameter(0)
  ROOT ar = f32[1048576] all-reduce(p), replica_groups={{}}, to_apply=add
}}
""")


def everyone(topology: Topology) -> list[list[int]]:
    return [list(range(topology.num_devices))]


# --- The alpha-beta formulas -------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 16, 1024])
def test_ring_formulas_hold_exactly(n):
    nbytes = 4 * MB
    assert cost_model.ring_all_reduce_time(nbytes, n, CHIP) == \
        2 * (n - 1) / n * nbytes / BANDWIDTH + 2 * (n - 1) * LATENCY
    assert cost_model.ring_all_gather_time(nbytes, n, CHIP) == \
        (n - 1) / n * nbytes / BANDWIDTH + (n - 1) * LATENCY
    assert cost_model.ring_reduce_scatter_time(nbytes, n, CHIP) == \
        (n - 1) / n * nbytes / BANDWIDTH + (n - 1) * LATENCY
    assert cost_model.ring_all_reduce_time(nbytes, n, CHIP, bidirectional=True) == \
        (n - 1) / n * nbytes / BANDWIDTH + 2 * (n - 1) * LATENCY


def test_bandwidth_term_does_not_grow_with_n_and_latency_term_grows_with_n_minus_1():
    no_latency = Chip("bw", 1.0, 1.0, BANDWIDTH, 0.0)
    big = 2.0 ** 40
    times = [cost_model.ring_all_reduce_time(big, n, no_latency) for n in (64, 256, 1024, 4096)]
    assert times == sorted(times) and times[-1] < 2 * big / BANDWIDTH
    assert times[-1] / times[1] < 1.004  # 2(N-1)/N: within 0.4% from 256 to 4096 chips
    for n in (2, 8, 64, 1024):
        assert cost_model.ring_all_reduce_time(0, n, CHIP) == 2 * (n - 1) * LATENCY


def test_2d_torus_formula_is_reduce_scatter_rows_all_reduce_columns_all_gather_rows():
    nbytes, rows, columns = 64 * MB, 4, 8
    in_rows = cost_model.ring_reduce_scatter_time(nbytes, columns, CHIP, bidirectional=True)
    in_columns = cost_model.ring_all_reduce_time(nbytes / columns, rows, CHIP, bidirectional=True)
    assert cost_model.torus_2d_all_reduce_time(nbytes, rows, columns, CHIP) == \
        2 * in_rows + in_columns
    torus = Topology.parse(f"torus:{rows}x{columns}")
    plan = plan_collective("all-reduce", nbytes, everyone(torus), torus, CHIP)
    assert plan.algorithm == "2-D torus 4x8"
    assert plan.time_s == pytest.approx(2 * in_rows + in_columns, rel=1e-12)


def test_2d_torus_beats_1d_ring_at_1024_chips_on_small_messages_and_prices_fast():
    pod = Topology.parse("torus:32x32")
    for nbytes in (64 * 1024, MB):
        ring = cost_model.ring_all_reduce_time(nbytes, 1024, CHIP, bidirectional=True)
        two_d = cost_model.torus_2d_all_reduce_time(nbytes, 32, 32, CHIP)
        assert two_d < ring / (10 if nbytes < MB else 2)
        started = time.perf_counter()
        plan = plan_collective("all-reduce", nbytes, everyone(pod), pod, CHIP)
        assert time.perf_counter() - started < 1.0
        assert plan.time_s <= two_d  # the model takes the fastest algorithm it knows
    large = plan_collective("all-reduce", 64 * MB, everyone(pod), pod, CHIP)
    assert large.algorithm == "2-D torus 32x32"
    assert large.time_s == pytest.approx(cost_model.torus_2d_all_reduce_time(64 * MB, 32, 32, CHIP), rel=1e-12)
    # 32 rows of all-reduces at once on the same pod: every row a physical ring of its own links.
    rows = [list(range(r * 32, r * 32 + 32)) for r in range(32)]
    in_rows = plan_collective("all-reduce", MB, rows, pod, CHIP)
    assert in_rows.algorithm == "bidirectional ring"
    assert in_rows.time_s == cost_model.ring_all_reduce_time(MB, 32, CHIP, bidirectional=True)


def test_pipelined_tree_formula_and_chunk_count():
    depth, nbytes = 4, 64 * MB
    for chunks in (1, 16, 1024):
        assert cost_model.tree_all_reduce_time(nbytes, depth, CHIP, chunks=chunks) == \
            (chunks + 2 * depth - 1) * (LATENCY + nbytes / chunks / BANDWIDTH)
    best = cost_model.tree_all_reduce_time(nbytes, depth, CHIP)
    assert all(best <= cost_model.tree_all_reduce_time(nbytes, depth, CHIP, chunks=k)
               for k in (1, 2, 8, 32, 64, 256, 4096))
    # Small messages: the tree's 2D + K - 1 rounds beat the 2-D algorithm's 2(R + C - 2) steps.
    small = plan_collective("all-reduce", 4096, everyone(Topology.parse("torus:16x16")), Topology.parse("torus:16x16"), CHIP)
    assert small.algorithm.startswith("pipelined tree, depth 16, ")


# --- Topology: physical rings, hops, link sharing, failed chips -----------------------------------


def test_group_that_is_a_physical_ring_uses_both_directions():
    module = all_reduce_module(16)
    step = cost_model.estimate(module, Topology.parse("ring:16"), CHIP, use_xla=False)
    (ar,) = step.collectives
    assert (ar.algorithm, ar.group_size, ar.bytes) == ("bidirectional ring", 16, 4 * MB)
    assert ar.time_s == 15 / 16 * 4 * MB / BANDWIDTH + 2 * 15 * LATENCY


def test_line_of_a_mesh_pays_the_longest_hop_in_every_step():
    mesh = Topology.parse("mesh:4x4")
    row = [[0, 1, 2, 3]]  # no wrap-around: the step from 3 back to 0 crosses 3 links
    plan = plan_collective("all-reduce", 4 * MB, row, mesh, CHIP)
    assert plan.algorithm == "ring, 3-hop steps"
    assert plan.time_s == 2 * 3 * (3 * LATENCY + MB / BANDWIDTH)


def test_concurrent_groups_sharing_links_share_their_bandwidth():
    ring = Topology.parse("ring:8")
    interleaved = [[0, 2, 4, 6], [1, 3, 5, 7]]  # every 2-hop step of one group crosses the other's
    plan = plan_collective("all-reduce", 4 * MB, interleaved, ring, CHIP)
    assert plan.algorithm == "bidirectional ring, 2-hop steps, links shared by 2"
    assert plan.time_s == 2 * 3 * (2 * LATENCY + (MB / 2) * 2 / BANDWIDTH)
    alone = plan_collective("all-reduce", 4 * MB, interleaved[:1], ring, CHIP)
    assert alone.time_s < plan.time_s


def test_collective_permute_pays_hops_and_shared_links():
    ring = Topology.parse("ring:4")
    assert collective_time("collective-permute", MB, [[0, 1]], ring, CHIP) == LATENCY + MB / BANDWIDTH
    crossing = plan_collective("collective-permute", MB, [[0, 2], [1, 3]], ring, CHIP)
    assert crossing.algorithm == "direct sends, up to 2 hops, links shared by 2"
    assert crossing.time_s == 2 * LATENCY + 2 * MB / BANDWIDTH


@pytest.mark.parametrize("shape", ["16x16", "32x32"])
def test_failed_chip_costs_something_but_little_on_a_large_all_reduce(shape):
    """One failed chip breaks the rows and columns of the 2-D algorithm; the pipelined tree over
    the healthy chips' links costs a BERT-large gradient 10-15% more than the healthy torus."""
    rows = int(shape.split("x")[0])
    tpu = cost_model.CHIPS["tpu-v3"]
    healthy = Topology.parse(f"torus:{shape}")
    failed = Topology.parse(f"torus:{shape}", failed=f"{rows // 2}:3")
    assert failed.num_devices == healthy.num_devices - 1
    bert, resnet = 4 * 340e6, 4 * 25.6e6
    before, after = (plan_collective("all-reduce", bert, everyone(t), t, tpu) for t in (healthy, failed))
    assert before.algorithm == f"2-D torus {shape}"
    assert after.algorithm.startswith("pipelined tree")
    assert before.time_s < after.time_s < 1.2 * before.time_s
    before, after = (collective_time("all-reduce", resnet, everyone(t), t, tpu) for t in (healthy, failed))
    assert before < after < 1.5 * before


def test_detour_around_a_failed_chip_shares_the_next_rows_links():
    """Rows of a torus all-reducing at once: the row with the hole closes its ring through the
    row above, whose links its own ring already uses in both directions."""
    failed = Topology.parse("torus:8x8", failed="4:4")
    rows = [[d for d in (failed.device_at((r, c)) for c in range(8)) if d is not None] for r in range(8)]
    plan = plan_collective("all-reduce", 64 * MB, rows, failed, CHIP)
    assert plan.algorithm == "bidirectional ring, 4-hop steps, links shared by 2"
    # The slowest is row 3: 8 chips, one-hop steps, but half of every step on a shared link.
    assert plan.time_s == 2 * 7 * (LATENCY + (64 * MB / 8 / 2) * 2 / BANDWIDTH)
    healthy = plan_collective("all-reduce", 64 * MB, [list(range(r * 8, r * 8 + 8)) for r in range(8)],
                              Topology.parse("torus:8x8"), CHIP)
    assert plan.time_s == 2 * healthy.time_s - 2 * 7 * LATENCY


def test_unreachable_or_unknown_devices_are_errors():
    split = Topology.parse("mesh:1x3", failed="0:1")
    with pytest.raises(cost_model.CostModelError, match="cut off"):
        collective_time("all-reduce", MB, [[0, 1]], split, CHIP)
    with pytest.raises(cost_model.CostModelError, match="not one of the 2 healthy devices"):
        collective_time("all-reduce", MB, [[0, 2]], split, CHIP)


# --- Which devices a module's groups name ---------------------------------------------------------


def test_group_modes_map_ids_to_global_devices():
    module = hlo_tools.parse_module(f"""HloModule m, replica_count=2, num_partitions=4
{ADD}
ENTRY main {{
  p = f32[8] parameter(0)
  cross_replica = f32[8] all-reduce(p), replica_groups={{{{0,1}}}}, to_apply=add
  replicas_and_partitions = f32[8] all-reduce(p), channel_id=1, replica_groups={{{{0}},{{1}}}}, to_apply=add
  flattened = f32[8] all-reduce(p), channel_id=2, replica_groups={{{{0,5}},{{1,4}},{{2,7}},{{3,6}}}}, use_global_device_ids=true, to_apply=add
  partitions = f32[8] all-to-all(p), channel_id=3, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}
  ROOT permute = f32[8] collective-permute(p), channel_id=4, source_target_pairs={{{{0,1}}}}
}}
""")

    def groups(name, kind):
        return cost_model.module_device_groups(module.find(name), kind, 2, 4)
    assert groups("cross_replica", "all-reduce") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replicas_and_partitions", "all-reduce") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("flattened", "all-reduce") == [[0, 5], [1, 4], [2, 7], [3, 6]]
    assert groups("partitions", "all-to-all") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("permute", "collective-permute") == [[0, 1], [4, 5]]
    step = cost_model.estimate(module, Topology.parse("torus:2x4"), CHIP, use_xla=False)
    assert [c.group_size for c in step.collectives] == [2, 4, 2, 4, 2]
    assert step.collective_time_s == sum(c.time_s for c in step.collectives) > 0


def test_device_count_must_match_the_topology():
    with pytest.raises(cost_model.CostModelError, match="16 devices .* 15 healthy chips"):
        cost_model.estimate(all_reduce_module(16), Topology.parse("torus:4x4", failed="1:2"), CHIP,
                            use_xla=False)
    counted = cost_model.estimate(all_reduce_module(16), Topology.parse("torus:4x4", failed="1:2"),
                                  CHIP, num_replicas=15, use_xla=False)
    assert counted.collectives[0].group_size == 15


def test_pricing_collectives_never_starts_jax():
    code = ("import sys; from hlo_tools.inspection import cost_model; "
            "from hlo_tools.inspection.topology import Topology; "
            "pod = Topology.parse('torus:32x32'); "
            "cost_model.collective_time('all-reduce', 1e8, [list(range(1024))], pod, cost_model.CHIPS['tpu-v4']); "
            "print('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout == "False\n"


# --- Compute -------------------------------------------------------------------------------------

DOT_MODULE = """HloModule dots, replica_count=1024

ENTRY main {
  a = f32[128,256] parameter(0)
  b = f32[256,64] parameter(1)
  ROOT d = f32[128,64] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_ir_estimate_counts_dot_flops_and_bytes_when_xla_cannot_compile():
    module = hlo_tools.parse_module(DOT_MODULE)
    step = cost_model.estimate(module, Topology.parse("torus:32x32"), CHIP)
    assert step.compute_source == "ir"
    assert "XLA could not compile it" in step.compute_note and "1024 devices" in step.compute_note
    assert step.flops == 2 * 128 * 64 * 256
    assert step.bytes_accessed == 4 * (128 * 256 + 256 * 64 + 128 * 64)
    assert step.compute_time_s == max(step.flops / CHIP.peak_flops, step.bytes_accessed / CHIP.hbm_bandwidth)
    assert step.step_time_s == step.compute_time_s


def test_ir_estimate_counts_convolution_flops():
    module = hlo_tools.parse_module("""HloModule conv
ENTRY main {
  i = f32[1,8,8,3] parameter(0)
  k = f32[3,3,3,5] parameter(1)
  ROOT c = f32[1,8,8,5] convolution(i, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
}
""")
    assert cost_model.ir_compute_cost(module)[0] == 2 * (8 * 8 * 5) * (3 * 3 * 3)


def test_jax_data_parallel_step_priced_on_a_2x4_torus():
    import jax  # noqa: PLC0415 - only this test needs jax
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))
    replicated, by_batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("batch"))

    def step(w, x, y):
        grad = jax.grad(lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2))(w)
        return w - 0.1 * grad

    args = [jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=replicated),
            jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=by_batch),
            jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=by_batch)]
    text = jax.jit(step, out_shardings=replicated).lower(*args).compile().as_text()
    module = hlo_tools.parse_module(text)
    estimate = cost_model.estimate(module, Topology.parse("torus:2x4"), cost_model.CHIPS["tpu-v4"])
    assert estimate.compute_source == "xla", estimate.compute_note
    assert estimate.flops >= 2 * 2 * (64 // 8) * 256 * 128  # forward and weight-gradient matmuls
    gradient = [c for c in estimate.collectives if c.opcode.startswith("all-reduce")]
    assert gradient and max(c.bytes for c in gradient) == 256 * 128 * 4
    assert {c.group_size for c in gradient} == {8}
    assert all(c.algorithm.startswith("2-D torus 2x4") or "ring" in c.algorithm for c in gradient)
    assert estimate.step_time_s == estimate.compute_time_s + estimate.collective_time_s
    assert estimate.collective_time_s > 0 and estimate.compute_time_s > 0


# --- The command line ------------------------------------------------------------------------------


def run(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def module_file(tmp_path):
    path = tmp_path / "ar16.hlo"
    path.write_text(all_reduce_module(16).to_text(), encoding="utf-8")
    return str(path)


def test_cli_json_has_the_documented_keys(capsys, module_file):
    status, out, err = run(capsys, "cost", module_file, "--topology", "torus:4x4", "--no_xla", "--json")
    assert status == 0 and err == ""
    report = json.loads(out)
    assert {"step_time_s", "compute_time_s", "collective_time_s", "topology", "link_bandwidth_bytes_per_s",
            "link_latency_s", "collectives", "compute_source", "chip", "failed"} <= set(report)
    (collective,) = report["collectives"]
    assert set(collective) == {"name", "opcode", "bytes", "group_size", "algorithm", "time_s"}
    tpu = cost_model.CHIPS["tpu-v3"]
    assert collective["time_s"] == cost_model.torus_2d_all_reduce_time(4 * MB, 4, 4, tpu)
    assert report["step_time_s"] == report["compute_time_s"] + report["collective_time_s"]
    assert (report["topology"], report["compute_source"], report["chip"]) == ("torus:4x4", "ir", "tpu-v3")


def test_cli_table(capsys, module_file):
    status, out, _ = run(capsys, "cost", module_file, "--topology", "torus:4x4", "--failed", "3:3",
                         "--num_replicas", "15", "--no_xla")
    assert status == 0
    assert "topology  torus:4x4 failed 3:3 (15 devices: 15 replicas x 1 partition)" in out
    assert "no overlap" in out
    header = next(line for line in out.splitlines() if line.startswith("name"))
    assert header.split() == ["name", "opcode", "bytes", "group", "time", "algorithm"]
    assert out.splitlines()[-1].split()[:4] == ["ar", "all-reduce", "4,194,304", "15"]


def test_cli_chip_override_flags(capsys, module_file):
    def report(*flags):
        status, out, _ = run(capsys, "cost", module_file, "--topology", "ring:16", "--no_xla", "--json",
                             "--chip", "tpu-v4", *flags)
        assert status == 0
        return json.loads(out)
    plain = report()
    faster = report("--link_bandwidth", "100e9", "--link_latency", "0", "--peak_flops", "1e15",
                    "--hbm_bandwidth", "2e12")
    assert (plain["link_bandwidth_bytes_per_s"], faster["link_bandwidth_bytes_per_s"]) == (50e9, 100e9)
    assert (faster["link_latency_s"], faster["peak_flops"], faster["hbm_bandwidth_bytes_per_s"]) == (0, 1e15, 2e12)
    assert faster["collectives"][0]["time_s"] == 15 / 16 * 4 * MB / 100e9
    assert "overridden" in faster["chip"]


def test_cli_device_counts_from_flags(capsys, module_file):
    """2 replicas x 8 partitions: the replica all-reduce pairs device p with 8 + p, a column of 2x8."""
    status, out, _ = run(capsys, "cost", module_file, "--topology", "torus:2x8", "--num_replicas", "2",
                         "--num_partitions", "8", "--no_xla", "--json")
    assert status == 0
    report = json.loads(out)
    assert (report["num_replicas"], report["num_partitions"]) == (2, 8)
    (collective,) = report["collectives"]
    assert (collective["group_size"], collective["algorithm"]) == (2, "ring")
    tpu = cost_model.CHIPS["tpu-v3"]
    assert collective["time_s"] == cost_model.ring_all_reduce_time(4 * MB, 2, tpu)


@pytest.mark.parametrize("argv, message", [
    (["--topology", "torus:4y4"], "topology 'torus:4y4' is not ring:N, torus:RxC or mesh:RxC"),
    (["--topology", "torus:4x4", "--failed", "1:2"],
     "the module runs on 16 devices (16 replicas x 1 partition) but the topology has 15 healthy chips"),
    (["--topology", "torus:4x4", "--failed", "9:9"], "failed chip 9:9 is outside torus:4x4 (4x4)"),
    (["--topology", "ring:16", "--link_bandwidth", "0"], "--link_bandwidth must be a number from 1e-30 to 1e+30, not 0"),
    # issue 24: what JSON cannot hold or a sum cannot reach, chips built before they were counted, digits
    (["--topology", "ring:16", "--json", "--link_latency", "inf"],
     "--link_latency must be 0 or a number from 1e-30 to 1e+30, not inf"),
    (["--topology", "ring:16", "--json", "--link_latency", "1e308"],
     "--link_latency must be 0 or a number from 1e-30 to 1e+30, not 1e+308"),
    (["--topology", "ring:16", "--link_bandwidth", "1e-320"],
     "--link_bandwidth must be a number from 1e-30 to 1e+30, not 9.99989e-321"),
    (["--topology", "ring:16", "--peak_flops", "nan"], "--peak_flops must be a number from 1e-30 to 1e+30, not nan"),
    (["--topology", "ring:16000"],  # counted, not built (huge ones: tests/cli/test_cli.py, in bounded memory)
     "the module runs on 16 devices (16 replicas x 1 partition) but the topology has 16000 healthy chips"),
    (["--topology", "ring:\u0661\u0666"], "topology 'ring:\u0661\u0666' is not ring:N, torus:RxC or mesh:RxC"),
    (["--topology", "torus:4x4", "--failed", "\u0661:\u0662"], "failed chip '\u0661:\u0662' is not ROW:COLUMN, e.g. 1:2"),
])
def test_cli_errors_are_one_line(capsys, module_file, argv, message):
    status, out, err = run(capsys, "cost", module_file, "--no_xla", *argv)
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("hlo-tools: error: ") and err.rstrip().endswith(message)


# --- docs/cost_model.md shows what the model prints ---------------------------------------------

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cost_model.md"


def test_docs_claims_table_is_what_the_model_prints():
    assert cost_model.format_claims() in DOC.read_text(encoding="utf-8")


def test_docs_failed_chip_session_is_what_the_command_prints(capsys, tmp_path):
    page = DOC.read_text(encoding="utf-8")
    command = "$ hlo-tools cost ar16.hlo --topology torus:4x4 --failed 1:2 --num_replicas 15 --no_xla\n"
    shown = page[page.index(command) + len(command):].split("```")[0]
    module = page[page.index("$ cat ar16.hlo\n") + len("$ cat ar16.hlo\n"):page.index("$ hlo-tools cost ar16.hlo")]
    (tmp_path / "ar16.hlo").write_text(module, encoding="utf-8")
    status, out, _ = run(capsys, "cost", str(tmp_path / "ar16.hlo"), "--topology", "torus:4x4",
                         "--failed", "1:2", "--num_replicas", "15", "--no_xla")
    assert status == 0 and out == shown


# --- Choosing the algorithm, and pricing each pass's result ---------------------------------------


def test_algorithms_limit_the_choice_to_what_a_program_fixes():
    torus = Topology.parse("torus:8x8")
    best = plan_collective("all-reduce", 64 * MB, everyone(torus), torus, CHIP)
    ring = plan_collective("all-reduce", 64 * MB, everyone(torus), torus, CHIP, algorithms={"ring"})
    two_d = plan_collective("all-reduce", 64 * MB, everyone(torus), torus, CHIP, algorithms={"2-D"})
    assert "ring" in ring.algorithm and two_d.algorithm.startswith("2-D torus 8x8")
    assert best.time_s == min(ring.time_s, two_d.time_s, best.time_s) < ring.time_s
    with pytest.raises(cost_model.CostModelError, match="unknown algorithm 'butterfly'"):
        plan_collective("all-reduce", MB, everyone(torus), torus, CHIP, algorithms={"butterfly"})
    with pytest.raises(cost_model.CostModelError, match="none of the algorithms 2-D"):
        plan_collective("all-reduce", MB, [[0, 1, 2, 3]], torus, CHIP, algorithms={"2-D"})


COMBINABLE = f"""HloModule m, replica_count=8
{ADD}
ENTRY main {{
  p = f32[1024,1024] parameter(0)
  q = f32[1024] parameter(1)
  ar0 = f32[1024,1024] all-reduce(p), replica_groups={{}}, to_apply=add
  ar1 = f32[1024] all-reduce(q), replica_groups={{}}, to_apply=add
  ROOT t = (f32[1024,1024], f32[1024]) tuple(ar0, ar1)
}}
"""


def test_xla_opt_report_prices_the_input_and_each_changing_pass(tmp_path, capsys):
    from xla_passes.tools import opt

    source = tmp_path / "m.hlo"
    source.write_text(COMBINABLE)
    argv = [str(source), "--passes=all-reduce-combiner,dce", "-o", str(tmp_path / "out.hlo"), "--report"]
    assert opt.main(argv + ["--topology", "torus:2x4"]) == 0
    lines = capsys.readouterr().err.splitlines()
    priced = [line for line in lines if "estimated step on torus:2x4 of tpu-v3" in line]
    assert len(priced) == 2, lines  # the input, and the combiner (dce changed nothing)
    before = cost_model.estimate(hlo_tools.parse_module(COMBINABLE), Topology.parse("torus:2x4"),
                                 cost_model.CHIPS["tpu-v3"], use_xla=False).step_time_s
    after = cost_model.estimate(hlo_tools.parse_module((tmp_path / "out.hlo").read_text()),
                                Topology.parse("torus:2x4"), cost_model.CHIPS["tpu-v3"], use_xla=False).step_time_s
    assert priced[0].endswith(f": {before * 1e3:.4g} ms")
    assert priced[1].endswith(f"after all-reduce-combiner: {after * 1e3:.4g} ms ({after / before:.2f}x the input's)")
    assert after < before  # one all-reduce pays the latency once

    assert opt.main(argv + ["--topology", "torus:4x4"]) == 0
    assert "not priced: the module runs on 8 devices" in capsys.readouterr().err
    assert opt.main(argv[:-1] + ["--topology", "torus:2x4"]) == 1
    assert capsys.readouterr().err.strip() == "xla-opt: error: --topology prices the steps of --report: add --report"


def test_report_shows_each_steps_estimated_time(tmp_path, capsys):
    from xla_passes.tools import opt

    source = tmp_path / "m.hlo"
    source.write_text(COMBINABLE)
    assert opt.main([str(source), "--passes=all-reduce-combiner", "--dump-to", str(tmp_path / "dump"),
                     "-o", str(tmp_path / "out.hlo")]) == 0
    page = tmp_path / "r.html"
    assert cli.main(["report", str(tmp_path / "dump"), "-o", str(page), "--topology", "torus:2x4"]) == 0
    html = page.read_text()
    assert "Estimated step times are for torus:2x4 of tpu-v3" in html and "<th class=num>estimated step</th>" in html
    after = cost_model.estimate(hlo_tools.parse_module((tmp_path / "out.hlo").read_text()),
                                Topology.parse("torus:2x4"), cost_model.CHIPS["tpu-v3"], use_xla=False)
    assert f"{after.step_time_s * 1e3:.3g} ms (0.89x)" in html
    assert cli.main(["report", str(tmp_path / "dump"), "-o", str(page), "--failed", "0:1"]) == 1
    assert capsys.readouterr().err.strip().endswith("--failed needs --topology")
    assert cli.main(["report", str(tmp_path / "dump"), "-o", str(page)]) == 0
    assert "estimated step" not in page.read_text()


def test_pod_scaling_prices_every_pass_and_a_failed_chip_costs_little():
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
    try:
        import pod_scaling
    finally:
        sys.path.pop(0)
    model = {"name": "toy", "batch": 1, "parameters": 4 * MB, "gradient_bytes": [4 * MB] * 4,
             "gradients": 1e9, "update": 1e7}
    healthy = pod_scaling.estimates(model, cost_model.CHIPS["tpu-v3"], failed=False)
    failed = pod_scaling.estimates(model, cost_model.CHIPS["tpu-v3"], failed=True)
    assert [row["chips"] for row in healthy] == [8, 64, 256, 1024, 4096]
    assert [row["chips"] for row in failed] == [7, 63, 255, 1023, 4095]
    for row in healthy:
        steps = row["steps"]
        assert steps["collective-fusion"] < steps["plain, 1-D ring"]  # one ring pays the latency once
        assert steps["weight-update-sharding"] < steps["all-reduce-2d"]  # the update is divided by N
        assert steps["plain"] <= steps["plain, 1-D ring"]
    for before, after in zip(healthy, failed):
        assert after["steps"]["all-reduce-rings"] is None  # no rings around failed chips
        assert before["steps"]["all-reduce-2d"] < after["steps"]["all-reduce-2d"] < 1.5 * before["steps"]["all-reduce-2d"]


def test_line_chart_is_one_svg_with_a_line_per_series():
    from xml.etree import ElementTree

    from hlo_tools.inspection import plot

    svg = plot.line_chart_svg({"a <b>": [(8, 0.01), (64, 0.02)], "c": [(8, 0.005), (64, 0.001), (4096, 0.2)]},
                              title="t", x_label="chips", y_label="ms", y_scale=1e3)
    root = ElementTree.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f".//{ns}polyline")
    assert [len(line.get("points").split()) for line in lines] == [2, 3]
    assert [g.find(f"{ns}title").text for g in root.findall(f"{ns}g")] == ["a <b>", "c"]
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.line_chart_svg({"a": [(0, 1)]}, title="t", x_label="x", y_label="y")
