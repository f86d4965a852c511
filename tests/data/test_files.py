"""What zoo writes gets the umask's modes, as other tools' files do (zoo/data/files.py): with umask 022 a teammate or
a job under another account on a shared file system can read every dataset, cache, checkpoint and export.

The reference is the umask arithmetic (0o666 / 0o777 less the umask) and ``tempfile``'s own 0600 / 0700, which the
renamed temporary files had before.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from zoo.data import files

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_temporary_files_and_folders_get_the_umask(tmp_path):
    for mask in (0o022, 0o027, 0o077):
        with umask(mask):
            fd, path = files.mkstemp(dir=tmp_path, prefix="data.bin.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(b"tokens")
            folder = files.mkdtemp(dir=tmp_path, prefix=".cache-build-")
            fd_ref, path_ref = tempfile.mkstemp(dir=tmp_path)
            os.close(fd_ref)
        name = os.path.basename(path)
        assert name.startswith("data.bin.") and name.endswith(".tmp") and Path(path).read_bytes() == b"tokens"
        assert mode(path) == 0o666 & ~mask and mode(folder) == 0o777 & ~mask and os.listdir(folder) == []
        assert mode(path_ref) == 0o600  # what tempfile makes whatever the umask: the bug this module removes
    names = set()
    for _ in range(50):
        fd, name = files.mkstemp(dir=tmp_path)
        os.close(fd)
        names.add(name)
    assert len(names) == 50


SCRIPT = r"""
import sys
from pathlib import Path

from zoo.progress import no_bars_in_logs

no_bars_in_logs()  # as the launch scripts do first

from zoo import load_model
from zoo.convert.cli import main as convert
from zoo.data.preprocess import main as preprocess
from zoo.training.train import main as train

src, out = Path(sys.argv[1]), Path(sys.argv[2])
assert preprocess(["--input", str(src), "--output-prefix", str(out / "data" / "docs"), "--train-tokenizer",
                   "--vocab-size", "300", "--tokenizer-out", str(out / "tok")]) == 0
# The default run (embedded corpus) builds its cache under data.cache_dir, here inside out/ and not in ~/.cache.
assert train(["--steps", "2", "--save-interval", "1", "--eval-interval", "0", "--no-sample", "--out", str(out / "run"),
              "--set", f"data.cache_dir={out / 'cache'}", "training.micro_batch_size=4", "training.global_batch_size=4",
              "training.seq_length=64"]) == 0
assert convert(["zoo-to-hf", "--src", str(out / "run" / "model"), "--out", str(out / "hf")]) == 0
load_model(out / "run" / "model").save_pretrained(out / "ft")
print("all written")
"""


def test_everything_a_run_writes_is_readable_by_group_and_others(tmp_path):
    """Under umask 022 in a fresh process: preprocess, the embedded corpus cache, two checkpoints, the exported
    model, its HF export and a library save. Every file is readable and every folder searchable by group and others,
    nothing is writable by them; and the logs, written to pipes, hold no \\r-drawn progress bar."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}: the cat sat on mat {i}."}) + "\n" for i in range(40)))
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                          os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(out)], capture_output=True, env=env,
                          umask=0o022, timeout=300)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0 and "all written" in stdout, stderr[-3000:]

    made = {p.relative_to(out).as_posix(): p for p in out.rglob("*")}
    for expected in ("data/docs.bin", "data/docs.idx", "tok/tokenizer.json", "run/checkpoints/latest",
                     "run/model/model.safetensors", "hf/config.json", "ft/model.safetensors"):
        assert expected in made, f"{expected} not written: {sorted(made)}"
    cache = [name for name in made if name.startswith("cache/") and name.endswith("embedded_text_document.bin")]
    steps = [name for name in made if name.startswith("run/checkpoints/step_") and name.count("/") == 2]
    assert cache and len(steps) == 2, sorted(made)
    wrong = []
    for name, path in sorted(made.items()):
        need = 0o055 if path.is_dir() else 0o044  # folders: read and search; files: read
        if mode(path) & need != need or mode(path) & 0o022:
            wrong.append(f"{oct(mode(path))} {name}")
    assert not wrong, "not readable by group/others under umask 022 (or writable by them):\n" + "\n".join(wrong)

    assert "\r" not in stdout + stderr
    assert "train: 100% 2/2" in stderr  # the bar's plain line in a log file
