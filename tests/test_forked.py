"""tests/forked.py: a forked child answers as a fresh interpreter would (exit code, stdout, stderr,
atexit hooks, environment, working directory, the helper processes it started), and falls back to
a real process where it cannot."""

import os
import signal
import subprocess
import sys

import pytest

from tests.forked import fork_usable, run_script

SCRIPT = r'''
import atexit, os, sys
atexit.register(lambda: print("atexit ran"))
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("PROBE"))
print("to stderr", file=sys.stderr)
action = sys.argv[1]
if action == "exit2":
    sys.exit("error: one line")
if action == "raise":
    raise ValueError("boom")
if action == "signal":
    os.kill(os.getpid(), 15)
if action == "code":
    sys.exit(int(sys.argv[2]))
'''


@pytest.mark.parametrize("args", [["ok"], ["exit2"], ["raise"], ["signal"], ["code", "3"]])
def test_a_forked_child_answers_as_a_fresh_interpreter(tmp_path, args):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    (tmp_path / "here").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE": "seen"}
    assert fork_usable(env)
    forked = run_script(script, args, env=env, cwd=tmp_path / "here", timeout=60)
    fresh = subprocess.run([sys.executable, str(script), *args], env=env, cwd=tmp_path / "here",
                           capture_output=True, text=True, timeout=60)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    if args == ["raise"]:  # the traceback's frames differ (runpy), its last line does not
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
        assert forked.stderr.startswith("to stderr\nTraceback")
    else:
        assert forked.stderr == fresh.stderr
    assert os.environ.get("PROBE") is None and signal.getsignal(signal.SIGTERM) is not None


def test_more_than_one_thread_or_the_switch_means_a_real_process(monkeypatch):
    assert not fork_usable({**os.environ, "OMP_NUM_THREADS": "2"})
    monkeypatch.setenv("IIET_TEST_FRESH_PROCESSES", "1")
    assert not fork_usable({**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_hung_child_is_killed_at_the_timeout_and_shows_where_it_hung(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ndef wait_forever():\n    time.sleep(600)\nwait_forever()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with pytest.raises(subprocess.TimeoutExpired) as stop:
        run_script(script, [], env=env, timeout=4)
    assert "wait_forever" in stop.value.stderr


MANAGER_SCRIPT = r'''
import multiprocessing, signal
if __name__ == "__main__":
    # as the trainer's spawned helpers do: they ignore SIGTERM and end when the trainer exits
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # held by an imported module, as megatron-core holds its writers' queue: alive to the end
    multiprocessing.kept_queue = multiprocessing.get_context("spawn").Manager().Queue()
    multiprocessing.kept_queue.put(1)
    print(multiprocessing.kept_queue._manager._process.pid)
'''


def test_a_manager_the_script_started_ends_with_it(tmp_path):
    # megatron-core's checkpoint writer starts such a manager; before the fix every forked save
    # test left one behind (~330 MB each, 28 after one CI run).
    script = tmp_path / "manager.py"
    script.write_text(MANAGER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_script(script, [], env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    os.kill(pid, signal.SIGKILL)  # do not leave it behind when the test fails
    pytest.fail(f"the manager process {pid} outlived the script that started it")
