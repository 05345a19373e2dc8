"""What ranks on several hosts write into one shared folder stays whole: two processes under different
hostnames (each in its own UTS namespace, `unshare -u`, as two cluster nodes) doing the same thing at once.

- the CPU peak file (``cpu_peak_tflops.json`` in the user cache): a read-compare-write per rank; the
  fastest rate either process measured survives (no lost update);
- Bridge's copy of its HF reference (:func:`nemo_anchor.atomic.copy_directory_once`): complete, once;
- the SmolLM2 preparation (:func:`nemo_anchor.export.pretrained.prepare_smollm2`): prepared once,
  the other process waits and reuses it.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -u` (root or user namespaces)")


def on_two_hosts(tmp_path, script: str, cache: Path, timeout: int = 600) -> list[str]:
    """Run ``script`` in two processes at once, on hosts node0 and node1; returns their stdouts.

    ``script`` sees ``HOST`` (its hostname) and starts when both processes are up.
    """
    go = tmp_path / "go"
    prologue = textwrap.dedent(f"""
        import os, socket, time
        from pathlib import Path
        HOST = socket.gethostname()
        Path({str(tmp_path)!r}, "ready-" + HOST).touch()
        while not Path({str(go)!r}).exists():
            time.sleep(0.01)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEMO_ANCHOR_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(["unshare", "-u", "sh", "-c", f'hostname {host}; exec "$@"', "sh",
                               sys.executable, "-c", prologue + textwrap.dedent(script)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for host in ("node0", "node1")]
    try:
        while len(list(tmp_path.glob("ready-node*"))) < 2:
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        go.touch()
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outputs]


def test_cpu_peak_file_loses_no_host_s_rate(tmp_path):
    """Each host remembers ever faster rates of its own precision, 300 times, in the one shared file;
    a host that writes what it read before the other host's write undoes that write (a lost update)."""
    cache = tmp_path / "cache"
    outputs = on_two_hosts(tmp_path, f"""
        import json
        from nemo_anchor.training.throughput import remembered_cpu_peak
        precision = {{"node0": "fp32", "node1": "bf16"}}[HOST]
        path = Path({str(cache)!r}, "cpu_peak_tflops.json")
        lost, remembered = 0, 0.0
        for rate in range(1, 301):
            stored = json.loads(path.read_text()) if path.exists() else {{}}
            mine = [value for key, value in stored.items() if key.endswith(precision)]
            lost += bool(remembered) and mine != [remembered]
            remembered = remembered_cpu_peak(precision, float(rate))[0]
        print(lost)
    """, cache)
    assert [int(out) for out in outputs] == [0, 0]
    stored = json.loads((cache / "cpu_peak_tflops.json").read_text())
    assert sorted((key.rsplit(" ", 1)[1], value) for key, value in stored.items()) == [("bf16", 300.0), ("fp32", 300.0)]
    assert not [p.name for p in cache.iterdir() if p.name.endswith("staging")]


def test_hf_reference_is_copied_once_and_whole(tmp_path):
    source = tmp_path / "reference"
    source.mkdir()
    for i in range(20):
        (source / f"file{i}.json").write_text(json.dumps({"i": i, "pad": "x" * 10000}))
    shared = tmp_path / "shared"
    on_two_hosts(tmp_path, f"""
        from nemo_anchor.atomic import copy_directory_once
        for run in range(40):
            copy_directory_once({str(source)!r}, Path({str(shared)!r}, str(run), "hf_reference"))
    """, tmp_path / "cache")
    for run in range(40):
        copied = shared / str(run)
        assert sorted(p.name for p in copied.iterdir()) == ["hf_reference"]  # no staging copy left behind
        assert sorted((copied / "hf_reference").iterdir()) == sorted(copied / "hf_reference" / p.name
                                                                     for p in source.iterdir())
        for path in source.iterdir():
            assert (copied / "hf_reference" / path.name).read_text() == path.read_text()


def test_smollm2_is_prepared_once_by_two_hosts(tmp_path):
    from nemo_anchor.export.pretrained import PretrainedUnavailable, is_prepared, smollm2_gguf

    try:
        smollm2_gguf()
    except PretrainedUnavailable as err:
        pytest.skip(f"SmolLM2 is not available offline: {err}")
    target = tmp_path / "shared" / "smollm2"
    outputs = on_two_hosts(tmp_path, f"""
        from nemo_anchor.export import pretrained
        prepare = pretrained._prepare
        def counted(*args):  # the real preparation, reported
            print("prepared on", HOST, flush=True)
            prepare(*args)
        pretrained._prepare = counted
        print(pretrained.prepare_smollm2({str(target)!r}))
    """, tmp_path / "cache")
    assert sum(out.count("prepared on") for out in outputs) == 1
    assert all(out.strip().endswith(str(target)) for out in outputs)
    assert is_prepared(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".smollm2.lock", "smollm2"]
