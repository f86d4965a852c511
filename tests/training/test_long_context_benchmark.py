"""launch/benchmark_long_context.py at tiny lengths: per-rank activation memory halves at cp=2, the longest-sequence
estimate follows from it, and a length the split cannot take is refused before anything is spawned."""

import json

from zoo.bench.long_context import main, measure_rank


def test_activation_memory_per_rank_halves_at_cp2(tmp_path, capsys, dist_run):
    """Each cp-rank world is the test's pool of that size instead of processes spawned by the benchmark."""
    def pool_world(args, cp):
        ranks = dist_run(cp, measure_rank, args, cp)
        return sorted((r for rows in ranks for r in rows), key=lambda r: (r["seq_length"], r["rank"]))

    out_json = tmp_path / "long.json"
    rc = main(["--seq-lengths", "256", "512", "--cp", "1", "2", "--steps", "1", "--warmup", "0", "--threads", "1",
               "--memory-budget-gb", "1", "--json", str(out_json)], world=pool_world)
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    assert sorted((r["cp"], r["rank"], r["seq_length"]) for r in rows) == [
        (1, 0, 256), (1, 0, 512), (2, 0, 256), (2, 0, 512), (2, 1, 256), (2, 1, 512)]
    for r in rows:
        assert r["local_tokens"] == r["seq_length"] // r["cp"] and r["step_time_s"] > 0 and r["activation_bytes"] > 0
        assert f"cp={r['cp']} rank {r['rank']} | seq {r['seq_length']:>6}" in out  # printed per rank
    act = {(r["cp"], r["rank"], r["seq_length"]): r["activation_bytes"] for r in rows}
    for s in (256, 512):
        # Every layer holds s/2 tokens; only the few bytes that do not scale with the local tokens keep it off 0.5.
        for rank in (0, 1):
            assert 0.49 <= act[2, rank, s] / act[1, 0, s] <= 0.65, (s, rank, act)
        assert 1.9 <= act[1, 0, 512] / act[1, 0, 256] <= 2.1, act  # linear in s
    # The estimate: (budget - model state) / bytes per local token x cp, on the split's grid (cp).
    fits = {f["cp"]: f for f in report["longest"]}
    state = rows[0]["state_bytes"]
    for cp in (1, 2):
        per_token = act[cp, 0, 512] / (512 // cp)
        assert fits[cp]["bytes_per_local_token"] == per_token
        assert fits[cp]["max_seq_length"] == int((2**30 - state) // per_token) * cp  # batch 1: a multiple of cp
    assert fits[2]["max_seq_length"] > 1.9 * fits[1]["max_seq_length"]
    assert "activations per rank at cp=2 / cp=1:" in out and "longest sequence in 1 GiB per rank" in out


def test_bad_length_is_refused_before_spawning(capsys):
    assert main(["--seq-lengths", "255", "--cp", "2", "--cp-algorithm", "ring"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cp=2, sequence length 255: sequence length 255 is not divisible by 4 = 2*cp at cp=2 "
                   "(ring: 2 chunks per rank, for the causal load balance); use a sequence length that is a multiple "
                   "of 4"], err
