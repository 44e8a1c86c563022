"""The benchmark program runs end to end on tiny shapes (timings are not asserted here)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from experiments import bench
from experiments.common import timing


def test_normalizers_benchmark_prints_a_table_with_every_row(tmp_path, capsys):
    output = tmp_path / "table.md"
    bench.main(
        [
            "normalizers",
            "--lengths",
            "16",
            "--heads",
            "2",
            "--head-dim",
            "8",
            "--repeats",
            "1",
            "--output",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    assert output.read_text() == printed
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "ms" not in line]
    names = {row.split("|")[1].strip() for row in rows}
    assert names == {"softmax", "sparsemax", "entmax15", "entmax α=1.3", "projection_simplex"}
    assert len(rows) == 5
    assert "FAILED" not in printed


def test_the_entmax_row_takes_one_alpha_per_head_as_an_array(monkeypatch, capsys):
    import sparse_jax

    seen = []

    def spy(x, alpha, axis=-1, *, where=None, _entmax=sparse_jax.entmax):
        seen.append((type(alpha), jnp.shape(alpha)))
        return _entmax(x, alpha, axis, where=where)

    monkeypatch.setattr(sparse_jax, "entmax", spy)
    flags = ["--which", "softmax", "entmax", "--lengths", "16", "--heads", "2", "--head-dim", "8"]
    bench.main(["normalizers", *flags, "--repeats", "1", "--entmax-alpha-per-head"])
    printed = capsys.readouterr().out
    names = {line.split("|")[1].strip() for line in printed.splitlines() if line.startswith("| ")}
    assert "entmax α=1.3 per head" in names and "FAILED" not in printed
    assert seen and all(t is not float and s == (2, 1) for t, s in seen)  # a traced [heads, 1]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--lengths", "0"], "lengths"),
        (["--entmax-alpha", "0.5"], "entmax_alpha must be finite and >= 1"),
        (["--repeats", "0"], "repeats"),
    ],
)
def test_bad_benchmark_flags_are_refused_before_anything_runs(flags, match, capsys):
    # tyro turns the config's ValueError into a usage error naming the flag's problem.
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["normalizers", *flags])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert match in captured.err + captured.out
    assert "|" not in captured.out  # no table: nothing was timed


def test_attention_benchmark_prints_every_mask_and_normalizer(capsys):
    bench.main(
        [
            "attention",
            "--lengths",
            "64",
            "--heads",
            "2",
            "--head-dim",
            "8",
            "--block",
            "16",
            "--window",
            "16",
            "--repeats",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| ") and "ms" not in line]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    assert {row[0] for row in rows} == {
        "causal",
        "causal & local(16, 0)",
        "(causal & local(16, 0)) \\| sink(4)",
        "strided(8) (causal)",
    }
    assert {row[4] for row in rows} == {"softmax", "sparsemax"}
    assert "density ratio" in printed


def test_the_query_chunks_benchmark_times_each_budgets_rows_and_the_default(capsys):
    bench.main(["query_chunks", "--shapes", "2x2x64x8", "--budgets", "1024", "4096", "262144",
                "--normalizers", "softmax", "--rounds", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    rows = [
        [cell.strip().strip("*") for cell in line.split("|")[1:-1]]
        for line in printed.splitlines()
        if line.startswith("| 2x2x64x8")
    ]
    assert len(rows) == 1
    row = rows[0]
    # rows per chunk: max(8, budget // (2 * 2 * 64)), at most T = 64; on CPU the default takes
    # 2**20 // 256 = 4096 rows, at least 2 * 8: the whole 64, one chunk
    assert [re.search(r"\((\d+) rows\)", c).group(1) for c in row[2:6]] == ["8", "16", "64", "64"]
    fastest_ms = _ms(row, int(row[6].split()[0]))  # "fastest": rows of the least time
    assert fastest_ms <= min(_ms(row, r) for r in (8, 16, 64))
    assert float(row[7].rstrip("x")) == pytest.approx(_ms(row, 64) / fastest_ms, abs=0.06)


def _ms(row: list[str], rows: int) -> float:
    """The milliseconds of the first cell of ``row`` timed at ``rows`` rows per chunk."""
    cell = next(c for c in row[2:6] if c.endswith(f"({rows} rows)"))
    return float(cell.split()[0].split("†")[0])


def test_the_selection_benchmark_times_the_gather_engine_its_dense_mask_and_causal(capsys):
    from sparse_jax.dynamic import BlockSelection

    bench.main(["selection", "--shapes", "1x2x64x8", "--keep-blocks", "1", "--block", "4",
                "--rounds", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in printed.splitlines()
        if line.startswith("| 1x2x64x8")
    ]
    assert [row[1] for row in rows] == ["forward", "fwd+bwd"]
    for row in rows:
        assert row[2] == f"{BlockSelection(1, block=4).formed(64) / 64**2:.3f}"
        gather, dense = (float(c.split()[0].split("†")[0]) for c in row[3:5])
        assert float(row[6].rstrip("x")) == pytest.approx(gather / dense, rel=0.05, abs=0.01)
    assert "BlockSelection(keep_blocks=1, block=4, local_blocks=1)" in printed
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["selection", "--block", "0"])
    assert exit_info.value.code == 2


def test_the_block_sizes_benchmark_times_each_block_and_names_the_hardened_heads_choice(capsys):
    from sparse_jax.masks import causal, local, sink
    from sparse_jax.models.flops import serving_block_size

    bench.main(["block_sizes", "--shapes", "1x2x128x8", "--windows", "8", "--rounds", "2"])
    printed = capsys.readouterr().out
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in printed.splitlines()
        if line.startswith("| 1x2x128x8")
    ]
    window = causal() & local(7, 0)
    masks = {"causal": causal(), "window(8)": window,
             "sink(4) ∪ window(8)": window | (sink(4) & causal())}  # fmt: skip
    assert [(row[1], row[2]) for row in rows] == [
        (name, which) for name in masks for which in ("forward", "fwd+bwd")
    ]
    for row in rows:
        assert int(row[6]) == serving_block_size(masks[row[1]], 128)[0]
        cells = [float(c.split()[0].split("†")[0]) for c in row[3:6]]
        ms = dict(zip((32, 64, 128), cells, strict=True))
        want = ms[int(row[6])] / min(ms.values())
        assert float(row[7].rstrip("x")) == pytest.approx(want, rel=0.05, abs=0.01)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["block_sizes", "--windows", "0"])
    assert exit_info.value.code == 2


def test_bad_query_chunks_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["query_chunks", "--shapes", "2x2x64"])
    assert exit_info.value.code == 2
    assert "shapes must be 'BxNxTxH'" in capsys.readouterr().err


def test_bad_attention_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["attention", "--block", "0"])
    assert exit_info.value.code == 2
    assert "block must be a positive integer" in capsys.readouterr().err


def test_kernels_benchmark_times_every_engine_on_every_cell(capsys):
    backend = jax.default_backend()
    fused = {"gpu": {"cudnn"}, "tpu": {"splash"}}.get(backend, set())  # softmax only
    bench.main(
        ["kernels", "--lengths", "32", "--batch", "1", "--heads", "2", "--head-dim", "16",
         "--block", "16", "--window", "8", "--normalizers", "sparsemax", "--masks", "local_sink",
         "--dense-up-to", "16", "--repeats", "1"] + (["--no-peers"] if backend == "gpu" else [])
    )  # fmt: skip
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| ") and "ms" not in line]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    cells = {(row[0], row[2], row[3]): row for row in rows}
    assert {engine for _, _, engine in cells} == {"xla", "blocksparse", "pallas"} | fused
    assert len(rows) == 3 + len(fused)
    for (_, _, engine), row in cells.items():
        if engine == "xla":  # above --dense-up-to: said, not timed
            assert row[4] == "–" and "dense O(n²) above 16" in row[6]
        elif engine in fused:
            assert row[4] == "–" and row[6] == "softmax only", row
        else:
            assert float(row[5].rstrip("†1")) > 0, row
    if backend == "cpu":
        assert "no PyTorch peers: not a GPU machine" in printed


def test_the_peers_rows_measured_before_the_time_limit_are_kept():
    """The peers' process prints a row per line; one that runs past its limit (AdaSplash's
    compilation took minutes on an H200) is killed and the rows it printed stay."""
    from experiments.bench.kernels import _stream_rows

    script = (
        "import json, time\n"
        "for peer in ('sdpa', 'flex'):\n"
        "    print(json.dumps({'peer': peer, 'fwd_bwd_ms': 1.5}), flush=True)\n"
        "print('bench_peers: compiling adasplash', flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.perf_counter()
    rows, note = _stream_rows([sys.executable, "-c", script], dict(os.environ), 3.0)
    assert time.perf_counter() - start < 30
    assert [row["peer"] for row in rows] == ["sdpa", "flex"]
    assert note == "the peers' process was stopped at its time limit (3 s) after 2 rows"
    rows, note = _stream_rows(
        [sys.executable, "-c", "print('{\"peer\": 1}'); raise SystemExit('boom')"],
        dict(os.environ), 30.0,
    )  # fmt: skip
    assert rows == [{"peer": 1}] and note.startswith("the peers' process failed after 1 rows")
    assert "boom" in note
    cell = {"mask": "causal", "n": 16, "normalizer": "softmax", "window": 4}
    request = {"batch": 1, "heads": 1, "head_dim": 8, "dtype": "float32", "repeats": 1}
    request["cells"] = [cell]
    command = [sys.executable, "-m", "experiments.bench.peers", json.dumps(request)]
    rows, note = _stream_rows(command, dict(os.environ), 120.0)
    if not rows:  # no torch or no CUDA here: the reason comes back
        assert note.startswith("no peer rows: bench_peers: ") and "no peers measured" in note


def _interrupt_on_second_call(monkeypatch, module, name: str) -> None:
    """``module.name`` runs once, then raises KeyboardInterrupt (a Ctrl-C mid-benchmark)."""
    real, calls = getattr(module, name), []

    def interrupt_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(module, name, interrupt_second)


def test_an_interrupted_kernels_benchmark_still_writes_what_it_measured(
    tmp_path, monkeypatch, capsys
):
    """`timeout --signal=INT` (.ci/gpu-check) or Ctrl-C: the table of the cells measured so
    far is printed and written, with a note, and the exit status is 130."""
    from experiments.bench import kernels as bench_kernels

    _interrupt_on_second_call(monkeypatch, bench_kernels, "_cells")
    output = tmp_path / "kernels.md"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(
            ["kernels", "--lengths", "32", "--batch", "1", "--heads", "2", "--head-dim", "16",
             "--block", "16", "--window", "8", "--normalizers", "sparsemax", "--masks", "local",
             "--engines", "blocksparse", "pallas", "--repeats", "1", "--output", str(output)]
        )  # fmt: skip
    assert exit_info.value.code == 130
    written = output.read_text()
    assert written == capsys.readouterr().out
    assert "| causal & local(8, 0) |" in written and "| blocksparse |" in written
    assert "| pallas |" not in written
    assert "INTERRUPTED after" in written and "Peers: interrupted." in written


def test_the_pallas_tuning_benchmark_times_every_combination_and_names_the_fastest(
    monkeypatch, capsys
):
    """Every combination of the flags gets its row and the fastest is named from the table. The
    cells' timings are stood in for: each cell's function is traced with its options (a
    combination pallas_attention refuses still fails here), not compiled, and takes a time of
    its own, all distinct, so that the fastest is one row; the real timing of a cell runs in
    test_an_interrupted_tuning_run_still_writes_what_it_measured, the kernels' values under each
    option in tests/test_kernels.py (compiling the 15 cells' interpreted forward and backward
    was most of this file's time)."""
    from experiments.bench import kernels as bench_kernels
    from experiments.common.timing import TimingStats

    fake_ms = iter([7.0, 3.0, 9.0, 1.5, 4.0, 8.0, 2.0, 6.0, 5.0, 2.5, 3.5, 7.5, 4.5, 6.5, 5.5] * 2)

    def traced_only(fn, *args, **limits):
        jax.eval_shape(fn, *args)
        seconds = next(fake_ms) / 1e3
        return TimingStats((seconds,), limits["repeats"], 0.0, seconds, None)

    monkeypatch.setattr(bench_kernels.timing, "time_fn", traced_only)
    bench.main(
        ["pallas_tuning", "--lengths", "32", "--batch", "1", "--heads", "2", "--head-dim", "16",
         "--layout-block", "32", "--forward-blocks", "32", "--backward-blocks", "0",
         "16x32", "--dq-blocks", "0", "16x32",
         "--num-warps", "4", "--num-stages", "2", "--window", "8", "--masks", "local",
         "--normalizers", "entmax15", "softmax", "--repeats", "1", "--dq-accumulation",
         "separate", "atomic", "--prefetch", "True", "False"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| causal")]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    # (forward tile, backward tiles, dq, prefetch): tile 32's backward 32 (0 is the forward's,
    # and the dq kernel's 0 the backward's) and 16x32, and 32 with the dq kernel on 16x32, which
    # atomic adds cannot take (they form dq on the dk/dv kernel's tiles); softmax, which skips
    # no block, without prefetching
    tiles = [("32", "32"), ("32", "16x32")]
    own_dq = ("32", "32, dq 16x32")
    modes = [(dq, pf) for dq in ("separate", "atomic") for pf in ("yes", "no")]
    combos = sorted((row[3], row[4], row[7], row[8]) for row in rows if row[2] == "entmax15")
    assert combos == sorted([(*tile, *mode) for tile in tiles for mode in modes]
                            + [(*own_dq, "separate", pf) for pf in ("yes", "no")])  # fmt: skip
    softmax = sorted((row[3], row[4], row[7], row[8]) for row in rows if row[2] == "softmax")
    assert softmax == sorted([(*tile, dq, "no") for tile in tiles for dq in ("separate", "atomic")]
                             + [(*own_dq, "separate", "no")])  # fmt: skip
    times = {tuple(row[3:9]): float(row[10].split("†")[0]) for row in rows if row[2] == "entmax15"}
    pattern = (r"fastest, causal & local\(8, 0\) n=32 entmax15: tiles ([\dx]+), "
               r"backward tiles ([\dx]+(?:, dq [\dx]+)?), (\d+) warps, (\d+) stages, dq (\w+), "
               r"prefetch (\w+)")  # fmt: skip
    (fastest,) = re.findall(pattern, printed)
    assert times[fastest] == min(times.values())  # the figure recomputed from the table
    interpreted = "interpret mode (warps and stages unused): not a timing" in printed
    assert interpreted == (jax.default_backend() == "cpu")  # a GPU's table holds timings
    assert "on the layout of blocks 32" in printed and "defaults: tiles 32, 4 warps" in printed
    for flags, message in [
        (["--dq-accumulation", "atomics"], "atomics"),
        (["--forward-blocks", "48"], "forward_blocks: 48 is not a power of two >= 16"),
        (["--forward-blocks", "256"], "forward_blocks: 256 is larger than"),  # tyro wraps it
        (["--backward-blocks", "8"], "backward_blocks: 8 is not a power of two >= 16"),
        (["--forward-blocks", "64x48"], "forward_blocks: 64x48 is not a power of two >= 16"),
        (["--forward-blocks", "64by64"], "forward_blocks: '64by64' is not a tile"),
        (["--forward-blocks", "0"], "forward_blocks: 0 is not a power of two"),  # backward's
        (["--dq-blocks", "12"], "dq_blocks: 12 is not a power of two"),
    ]:
        with pytest.raises(SystemExit):
            bench.main(["pallas_tuning", *flags])
        assert message in capsys.readouterr().err, flags
    if jax.default_backend() == "cpu":
        bench.main(["pallas_tuning", "--lengths", "4096"])
        assert "n=4096: not run (interpret mode on CPU: too slow" in capsys.readouterr().out


def test_an_interrupted_tuning_run_still_writes_what_it_measured(tmp_path, monkeypatch, capsys):
    from experiments.bench import kernels as bench_kernels

    _interrupt_on_second_call(monkeypatch, bench_kernels, "_tuned_cells")
    output = tmp_path / "tuning.md"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(
            ["pallas_tuning", "--lengths", "32", "--batch", "1", "--heads", "1", "--head-dim",
             "16", "--layout-block", "16", "--forward-blocks", "16", "--num-warps", "4", "8",
             "--num-stages", "2", "--window", "8", "--masks", "local", "--normalizers",
             "sparsemax", "--repeats", "1", "--output", str(output)]
        )  # fmt: skip
    assert exit_info.value.code == 130
    written = output.read_text()
    assert written == capsys.readouterr().out
    rows = [line for line in written.splitlines() if line.startswith("| causal")]
    assert len(rows) == 1 and "INTERRUPTED after" in written


def test_the_configs_adasplash_autotuned_are_recorded_beside_its_timings(monkeypatch, capsys):
    import types

    from experiments.bench import kernels as bench_kernels
    from experiments.bench import peers as bench_peers

    class Autotuner:  # the name of triton.runtime.autotuner.Autotuner, read after a run
        def __init__(self, best):
            self.best_config = best

    module = types.ModuleType("adasplash.adasplash_v2")
    module._fwd, module._bwd, module.helper = (
        Autotuner("BLOCK_M: 64, num_warps: 4"),
        Autotuner(None),
        3,
    )
    monkeypatch.setitem(sys.modules, "adasplash.adasplash_v2", module)
    monkeypatch.setitem(sys.modules, "adasplashy", types.ModuleType("adasplashy"))
    assert bench_peers._autotuned_configs("adasplash") == {
        "adasplash_v2._fwd": "BLOCK_M: 64, num_warps: 4"
    }  # only the package's own modules, only kernels that ran
    row = {"mask": "causal", "n": 32, "normalizer": "entmax15", "window": 8,
           "peer": "adasplash-2", "fwd_ms": 1.0, "fwd_bwd_ms": 3.0,
           "autotuned": {"adasplash_v2._fwd": "BLOCK_M: 64, num_warps: 4"}}  # fmt: skip
    monkeypatch.setattr(bench_kernels, "_peer_rows", lambda *args: ([row], "measured"))
    bench.main(
        ["kernels", "--lengths", "32", "--batch", "1", "--heads", "1", "--head-dim", "16",
         "--block", "16", "--window", "8", "--normalizers", "entmax15", "--masks", "causal",
         "--engines", "blocksparse", "--repeats", "1"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    (line,) = [
        line
        for line in printed.splitlines()
        if line.startswith("| causal |") and "adasplash" in line
    ]
    assert [cell.strip() for cell in line.split("|")[1:-1]][:6] == [
        "causal", "32", "entmax15", "adasplash-2", "1.00", "3.00"
    ]  # fmt: skip
    assert ("adasplash-2 (n=32, entmax15): Triton's autotuner chose adasplash_v2._fwd: "
            "BLOCK_M: 64, num_warps: 4") in printed  # fmt: skip


def test_the_search_passes_count_is_recomputed_from_the_searches(capsys):
    import numpy as np

    from experiments.bench.passes import count_passes
    from sparse_jax import normalizers as nz

    bench.main(["search_passes", "--lengths", "256", "--scales", "1.0", "--rows", "16",
                "--block", "32", "--normalizers", "sparsemax"])  # fmt: skip
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if line.startswith("| sparsemax")]
    cells = [cell.strip() for cell in line.split("|")[1:-1]]
    rng = np.random.default_rng(0)  # the benchmark's seed and draw
    x = rng.standard_normal((16, 256))
    z = np.float32(x - x.max(-1, keepdims=True))
    # The kernels' start values, by numpy: each 32-key block's 2 largest, the 16 largest of
    # those (here all of them)
    blocks = -np.sort(-z.reshape(16, 8, 32), axis=-1)[..., :2].reshape(16, 16)
    kept = -np.sort(-blocks, axis=-1)[:, :16]
    start = nz.sparsemax_start([jnp.asarray(kept[:, i : i + 1]) for i in range(16)])
    z, done = jnp.asarray(z), jnp.zeros((16, 1), bool)
    minus_one = jnp.full((16, 1), -1.0)
    base, base_rows, _ = count_passes(nz.sparsemax_search(minus_one, done, 256, smallest=True), z)
    ours, our_rows, _ = count_passes(nz.sparsemax_search(start, done, 256, smallest=True), z)
    assert cells[:6] == ["sparsemax", "256", "1", "16", str(base), str(ours)]
    assert cells[6:8] == [f"{base_rows.mean():.1f}", f"{our_rows.mean():.1f}"]
    assert ours < base
    assert "of each 32-key block's 2 largest values of a row" in printed
    with pytest.raises(SystemExit):
        bench.main(["search_passes", "--lengths", "100", "--block", "64"])
    assert "must be multiples of block 64" in capsys.readouterr().err


def test_the_teacher_search_passes_are_counted_on_its_own_causal_scores(capsys):
    import numpy as np

    from experiments.bench import passes
    from experiments.bench.passes import count_passes
    from experiments.common import teachers
    from sparse_jax import normalizers as nz
    from sparse_jax.models import from_pretrained

    bench.main(["search_passes", "--scores", "teacher", "--lengths", "128", "--rows", "16",
                "--block", "32", "--windows", "2", "--normalizers", "sparsemax"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "the bundled teacher's" in printed and "first 2 windows" in printed
    lines = [line for line in printed.splitlines() if line.startswith("| sparsemax")]
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    assert [(c[2], c[6]) for c in cells] == [
        (layer, start) for layer in ["all", "0", "1", "2", "3"] for start in ["-1", "kernels' (16)"]
    ]
    # The scores are the teacher's own: softmax of layer 0's rows is its attention's output
    ids = passes.evaluation_windows(128, 2)
    scores = passes.teacher_scores(ids)  # [L, W, N, q, k]
    assert scores.shape == (4, 2, 4, 128, 128)
    future = ~np.tri(128, dtype=bool)
    assert np.isneginf(scores[..., future]).all() and np.isfinite(scores[..., ~future]).all()
    model = from_pretrained(teachers.BUNDLED)
    block = model.h[0]
    x = block.ln_1(model.embed(jnp.asarray(ids), jnp.arange(128)))
    v = block.attn.c_attn(x).reshape(2, 128, 3, 4, 64)[:, :, 2]
    mixed = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(jnp.asarray(scores[0]), -1), v)
    expected = block.attn(x, jnp.arange(128))[0]
    np.testing.assert_allclose(block.attn.c_proj(mixed.reshape(2, 128, 256)), expected,
                               atol=2e-5)  # fmt: skip
    # Each layer's row of the table, from the benchmark's per-tile counts
    per_layer = [passes.tile_passes("sparsemax", s.reshape(-1, 128), 16, 16, 2, 32)
                 for s in scores]  # fmt: skip
    for layer in range(4):
        for i in range(2):
            tiles = per_layer[layer][i].tiles
            assert tiles.shape == (2 * 4 * 8,)
            row = cells[2 + 2 * layer + i]
            assert row[3] == "64" and row[-4:-1] == [
                f"{tiles.mean():.2f}",
                str(tiles.max()),
                f"{per_layer[layer][i].rows.mean():.2f}",
            ]
            assert row[7] == f"{100 * np.mean(tiles == 1):.0f}%"

    # Layer 1's tiles counted again one by one, without the benchmark's batching: a tile's
    # rows over its kept blocks only, the start values by numpy (each 32-key block's 2
    # largest, the 16 largest of those)
    def count(tile):
        z = np.float32(tile - tile.max(-1, keepdims=True))
        blocks = -np.sort(-z.reshape(16, -1, 32), axis=-1)[..., :2].reshape(16, -1)
        top = -np.sort(-blocks, axis=-1)[:, :16]
        top = np.concatenate([top, np.full((16, 16 - top.shape[1]), -np.inf, np.float32)], -1)
        start = nz.sparsemax_start([jnp.asarray(top[:, i : i + 1]) for i in range(16)])
        z, done = jnp.asarray(z), jnp.zeros((16, 1), bool)
        minus_one = jnp.full((16, 1), -1.0)
        n = z.shape[-1]
        base = count_passes(nz.sparsemax_search(minus_one, done, n, smallest=True), z)[0]
        ours = count_passes(nz.sparsemax_search(start, done, n, smallest=True), z)[0]
        return base, ours

    recounted = []
    for w, h, q in np.ndindex(2, 4, 8):  # the tiles' order: window, head, query tile
        kept = -(-(q + 1) * 16 // 32) * 32  # keys of the blocks up to the diagonal
        tile = np.float64(scores[1, w, h, q * 16 : (q + 1) * 16, :kept])
        assert np.isneginf(tile[0]).any() and np.isfinite(tile[:, 0]).all()
        recounted.append(count(tile))
    base, ours = np.asarray(recounted).T
    assert base.tolist() == per_layer[1][0].tiles.tolist()
    assert ours.tolist() == per_layer[1][1].tiles.tolist()
    assert base.max() >= 3 and (ours < base).any()  # not tiles every count gets right
    # Bad flags are refused by name, before anything is loaded
    with pytest.raises(SystemExit):
        bench.main(["search_passes", "--scores", "teacher", "--lengths", "1024"])
    err = capsys.readouterr().err
    assert "lengths [1024] with --scores teacher" in err and "at most the teacher's 512" in err
    with pytest.raises(ValueError, match=r"lengths \[96\] .* multiple of block 64"):
        passes.SearchPassesConfig(scores="teacher", lengths=(96,))
    with pytest.raises(ValueError, match=r"lengths \[128\] .* multiple of rows 48"):
        passes.SearchPassesConfig(scores="teacher", lengths=(128,), rows=48, block=32)
    with pytest.raises(ValueError, match="windows must be a positive integer, got 0"):
        passes.SearchPassesConfig(scores="teacher", lengths=(128,), windows=0)
    with pytest.raises(SystemExit):
        bench.main(["search_passes", "--scores", "bert"])
    assert "--scores" in capsys.readouterr().err


def test_the_forward_passes_benchmark_times_each_cap_and_derives_the_cost_per_pass(capsys):
    bench.main(["forward_passes", "--lengths", "64", "--block", "16", "--window", "8",
                "--batch", "1", "--heads", "1", "--head-dim", "16", "--masks", "local",
                "--normalizers", "entmax15", "sparsemax", "--passes", "0", "2", "--repeats", "1",
                "--start-values", "4"])  # fmt: skip
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| causal")]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    assert [row[2:4] for row in rows] == [
        ["softmax", "–"], ["entmax15", "0"], ["entmax15", "2"], ["entmax15", "to the end"],
        ["entmax15", "to the end, output pass"], ["entmax15", "to the end, start 4"],
        ["sparsemax", "0"], ["sparsemax", "2"],
        ["sparsemax", "to the end"], ["sparsemax", "to the end, output pass"],
        ["sparsemax", "to the end, start 4"],
    ]  # fmt: skip
    cells = [row[4].split("†")[0] for row in rows]
    ms = [float(cell) for cell in cells]
    per_pass = (ms[2] - ms[1]) / 2  # the figure recomputed from the table
    # The table rounds to 3 significant digits (interpreted cells over 100 ms to whole ms on a
    # slow machine): the recomputed figure is as exact as the two cells' last digits allow.
    unit = [10.0 ** -len(cell.partition(".")[2]) for cell in cells[1:3]]
    tolerance = sum(unit) / 4 + 0.006
    assert float(rows[2][5]) == pytest.approx(per_pass, abs=tolerance)
    finding = re.findall(r"(-?[\d.]+) ms per search pass \(0-2\)", printed)[0]
    assert float(finding) == pytest.approx(per_pass, abs=tolerance)  # from unrounded medians
    assert "CPU: interpret mode: not a timing" in printed
    for flag, message in [(["--passes", "2", "1"], "passes must increase"),
                          (["--passes", "-1"], "passes must be ints >= 0"),
                          (["--start-values", "0"], "start_values must be positive")]:  # fmt: skip
        with pytest.raises(SystemExit):
            bench.main(["forward_passes", *flag])
        assert message in capsys.readouterr().err


def test_bad_kernels_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["kernels", "--normalizers", "0.5"])
    assert exit_info.value.code == 2
    assert "finite α >= 1 (1 is softmax)" in capsys.readouterr().err


def test_the_prepared_gpu_check_runs_commands_that_parse():
    """.ci/gpu-check is run on a lent GPU with minutes of device time: a flag or a test file that
    does not exist would waste them, so every command it runs is checked here."""
    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / ".ci" / "gpu-check"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = script.read_text().replace("\\\n", " ")
    benches = re.findall(r"python3 -m experiments\.bench (.*)", text)
    pytests = re.findall(r"python3 -m pytest (.*)", text)
    assert len(benches) == 5 and len(pytests) == 2
    configs = []
    for line in benches:
        args = shlex.split(line.replace('"$out', '"/tmp/gpu-check'))
        configs.append(bench.parse(args))
    assert configs[0].lengths == (16384,) and set(configs[0].engines) == {"pallas", "cudnn"}
    assert type(configs[0]).__name__ == "KernelsConfig" and configs[0].peers_timeout_s == 180
    passes, tiles = configs[1:3]
    assert type(passes).__name__ == "ForwardPassesConfig" and passes.lengths == (16384,)
    assert passes.start_values == (8, 16, 64)
    assert type(tiles).__name__ == "TuningConfig" and tiles.lengths == (16384,)
    assert tiles.forward_blocks == ("64", "128", "64x128", "128x64")
    assert tiles.backward_blocks == ("0", "32x128", "32x64")
    assert tiles.dq_blocks == ("0", "128x32", "64x32") and tiles.num_warps == (4,)
    assert "gpu-check suite" in text  # the second prepared call
    (request,) = re.findall(r"request='(.*?)'", text, re.DOTALL)  # part "peers"
    request = json.loads(request)
    assert {cell["normalizer"] for cell in request["cells"]} == {"entmax15", "sparsemax"}
    assert all(cell["mask"] == "causal" for cell in request["cells"])  # what AdaSplash computes
    # the suite's tests: GPU_CHECK_TESTS, by default the whole folder
    (default,) = re.findall(r"tests=\$\{GPU_CHECK_TESTS:-(\S+)\}", text)
    for line in pytests:
        args = [default if arg == "$tests" else arg for arg in shlex.split(line)]
        files = [arg for arg in args if arg.split("/")[0] == "tests"]
        assert files and all((root / f).exists() for f in files), files
    assert "--session-timeout" in pytests[1]  # a cut run still writes its failures
    from experiments import cot as cot_experiment

    (cot_line,) = re.findall(r"python3 -m experiments\.cot (.*)", text)
    cot_run = cot_experiment.parse(shlex.split(cot_line))
    assert cot_run.train.steps == 40 and cot_run.model.d_model == 256  # the study preset

    # the device tool returns at most 8 files from $OUT: each part writes the common files
    # (outside the part's branch) and its own
    def outputs(chunk):
        found = set(re.findall(r"\$out/([\w.-]+)", chunk))
        return found | set(re.findall(r'^\s*step "[^"]+" \S+ (\S+)', chunk, re.MULTILINE))

    start = text.index("if [[ $part == kernels ]]")
    end = text.index("\nfi\n", start)
    branches = re.split(r"\nelif |\nelse\n", text[start:end])
    common = outputs(text[:start] + text[end:])
    assert len(branches) == 5 and {"env.txt", "gpu-check.log"} <= common
    for branch in branches:
        assert len(common | outputs(branch)) <= 8, sorted(common | outputs(branch))
    assert "forward-passes.md" in outputs(branches[0])


def test_the_checkouts_benchmark_times_each_commits_own_library(monkeypatch, capsys):
    """Each commit's sparse_jax/ is extracted from git and timed in its own process (the
    process reports which library it imported); the table's figures are recomputed from what
    the processes measured."""
    from experiments.bench import checkouts

    measured, time_commit = [], checkouts.time_commit

    def spy(folder, config):
        measured.append((folder, time_commit(folder, config)))
        return measured[-1][1]

    monkeypatch.setattr(checkouts, "time_commit", spy)
    flags = ["--refs", "HEAD", "HEAD", "--length", "64", "--heads", "1", "--head-dim", "8",
             "--block", "16", "--window", "8", "--rounds", "1", "--repeats", "2"]  # fmt: skip
    bench.main(["checkouts", *flags])
    printed = capsys.readouterr().out
    folders = [folder for folder, _ in measured]
    assert len(folders) == 2 and folders[0] != folders[1]  # one extracted library per ref
    assert all(not (folder / "sparse_jax" / "dispatch.py").exists() for folder in folders)  # gone
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=checkouts.ROOT, check=True).stdout.strip()  # fmt: skip
    rows = [line.split("|")[1:-1] for line in printed.splitlines() if line.startswith("| HEAD")]
    assert len(rows) == 2
    first = measured[0][1]["fwd+bwd"]
    for row, (_, times) in zip(rows, measured, strict=True):
        cells = [c.strip() for c in row]
        assert cells[1] == head[:10]
        assert cells[2] == timing.ms_text(1e3 * times["fwd"])
        assert cells[3] == timing.ms_text(1e3 * times["fwd+bwd"])
        assert cells[4] == f"{times['fwd+bwd'] / first:.2f}x"
        assert cells[5] == f"{times['fwd'] / measured[0][1]['fwd']:.2f}x"
    assert "mask=causal & local(7, 0), normalizer='softmax', impl='blocksparse'" in printed


def test_the_checkouts_benchmark_refuses_what_git_does_not_know(capsys):
    with pytest.raises(ValueError, match=r"`refs` holds 'no-such-commit', which is not a commit"):
        bench.main(["checkouts", "--refs", "no-such-commit"])
    for flag in ("--rounds", "--window"):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(["checkouts", flag, "0"])
        assert exit_info.value.code == 2
        assert f"{flag[2:]} must be a positive integer" in capsys.readouterr().err


def test_the_hardening_benchmark_times_each_models_own_attention_core(monkeypatch, capsys):
    """The attention column times block 0's core of each model as the model runs it (the
    dense one's xla engine; the hardened pattern on the block-sparse engine, each head at the
    blocks harden() chose), and the ratio is recomputed from the timed calls and the FLOPs."""
    from experiments.bench import hardening
    from tests.engines import engines_used

    timed, counted = [], []
    time_fn, model_flops = timing.time_fn, hardening.model_flops

    def spy_time(fn, *args, **kwargs):
        timed.append((fn, args, time_fn(fn, *args, **kwargs)))
        return timed[-1][2]

    def spy_flops(model, n):
        counted.append(model_flops(model, n))
        return counted[-1]

    monkeypatch.setattr(timing, "time_fn", spy_time)
    monkeypatch.setattr(hardening, "model_flops", spy_flops)
    flags = ["--lengths", "128", "--layers", "1", "--width", "32", "--heads", "4",
             "--block", "16", "--repeats", "1"]  # fmt: skip
    bench.main(["hardening", *flags])
    printed = capsys.readouterr().out
    (_, _, forward_dense), (_, _, forward_hard), dense_call, hard_call = timed
    assert engines_used(dense_call[0], *dense_call[1]) == {"xla"}
    assert engines_used(hard_call[0], *hard_call[1]) == {"blocksparse"}
    # ... through the layer's per-head blocks: one engine call per group of equal blocks.
    from sparse_jax.models import layers

    groups, by_block_size = [], layers.attention_by_block_size

    def spy_groups(q, k, v, groups_, *args):
        groups.append([size for size, _, _ in groups_])
        return by_block_size(q, k, v, groups_, *args)

    monkeypatch.setattr(layers, "attention_by_block_size", spy_groups)
    jax.make_jaxpr(lambda *args: hard_call[0](*args))(*hard_call[1])  # a new trace, not cached
    assert len(groups) == 1 and len(groups[0]) >= 2, groups  # the causal heads' and the rest
    rows = {
        cells[0]: cells[1:]
        for line in printed.splitlines()
        if line.startswith(("| dense", "| hardened"))
        for cells in [[c.strip() for c in line.split("|")[1:-1]]]
    }
    assert rows["dense"][4] == timing.format_ms(forward_dense)
    assert rows["dense"][6] == timing.format_ms(dense_call[2])
    assert rows["hardened"][6] == timing.format_ms(hard_call[2])
    assert rows["hardened"][4] == timing.format_ms(forward_hard)
    density = counted[1].attention_density
    ratio = hard_call[2].median_s / (density * dense_call[2].median_s)
    assert rows["hardened"][7] == f"{ratio:.2f}"
    assert "each head at the blocks harden() chose for it: head 0 " in printed
