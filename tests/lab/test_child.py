"""A lab job stops with its parent: SIGINT / SIGTERM to ``kvstate lab reproduce`` or ``kvstate lab retrain``
stops the job's processes too, and the parent exits 130."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# the job: a Python process whose own child writes a journal (a grandchild of the parent, as a real job's
# worker processes are)
WRITER = textwrap.dedent("""
    import subprocess, sys
    from pathlib import Path
    loop = "import time\\nwhile True:\\n    f = open(%r, 'a'); f.write('unit\\\\n'); f.close(); time.sleep(0.05)" % sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", loop])
    Path(sys.argv[1]).write_text(str(child.pid))
    child.wait()
""")

# the parent: the real CLI, with the job list (reproduce) or the model's recorded parts (retrain) pointing at it
PARENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvstate.cli import main
    from kvstate.lab.make import reproduce as R
    from kvstate.lab.training import retrain as T
    tmp, command, which = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    R.REPO = T.REPO = tmp
    R.jobs = lambda: [R.Job("x:job", "out.json", command, 1.0)]
    main(["lab", "reproduce", "--only", "x:job"] if which == "reproduce"
         else ["lab", "retrain", str(tmp / "models" / "m"), "--scratch", str(tmp / "runs" / "m")])
""")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped


@pytest.mark.parametrize("which", ["reproduce", "retrain"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_parent_stops_the_job(tmp_path, which, sig):
    (tmp_path / "writer.py").write_text(WRITER)
    pid_file, journal = tmp_path / "child.pid", tmp_path / "journal"
    command = f"{sys.executable} {tmp_path / 'writer.py'} {pid_file} {journal} --out runs/a"
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "training_state.json").write_text(json.dumps(
        {"step": 1, "seconds": 1.0, "commands": [{"command": command, "out": "runs/a", "resume": None,
                                                    "from_step": 0}]}))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), command, which],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.is_file() and pid_file.read_text() and journal.is_file()):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=60)
        assert parent.returncode == 130, err
        time.sleep(0.3)
        assert not _alive(child)
        size = journal.stat().st_size
        time.sleep(0.3)
        assert journal.stat().st_size == size  # nothing writes the journal any more
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid_file.is_file() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
