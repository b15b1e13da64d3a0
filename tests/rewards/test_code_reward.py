"""Sandboxed code reward (grpo_jax/rewards/code.py): scores, program extraction, the registered
reward and verl routing, and a sandbox suite where every hostile program is contained: the right
(partial) score, within its time, no process left behind, nothing written outside its workdir,
and the test process (the "trainer") unaffected. Each sandbox case runs under three guard sets:

  full        what scoring uses: the namespaces this machine allows + rlimits + audit hook
  os_only     namespaces + rlimits without the audit hook (the OS layer alone; needs PID,
              network and mount namespaces, else skipped)
  audit_only  no namespaces: rlimits (+ uid drop as root) + audit hook (the fallback path)

Timings are printed (`pytest -s tests/rewards/test_code_reward.py` shows them)."""

import json
import os
import resource
import secrets
import signal
import socket
import tempfile
import time

import pytest

from grpo_jax.rewards import code
from grpo_jax.rewards import registry
from grpo_jax.rewards import scoring

GOOD = "def f(x):\n  return 2 * x\n"
TESTS = ["assert f(2) == 4", "assert f(0) == 0", "assert f(-3) == -6"]
SLACK = 2.5  # seconds beyond the timeout a run may take (interpreter start-up on a busy CI box)


def fenced(program, lang="python"):
  return f"Here is my solution.\n\n```{lang}\n{program}```\n\nIt doubles x."


# ------------------------------------------------------------------------------- scoring


def test_correct_program_scores_one():
  assert code.score(fenced(GOOD), TESTS) == 1.0
  assert code.score(GOOD, TESTS) == 1.0  # no fence: the whole text is the program


def test_partially_correct_program_scores_the_fraction():
  square = "def f(x):\n  return x * x\n"  # right for 2 and 0, wrong for -3
  assert code.score(fenced(square), TESTS) == pytest.approx(2 / 3)
  raising = "def f(x):\n  if x < 0:\n    raise ValueError(x)\n  return 2 * x\n"
  assert code.score(fenced(raising), TESTS) == pytest.approx(2 / 3)


def test_syntax_error_and_failed_load_score_zero():
  assert code.score(fenced("def f(x) return 2 * x\n"), TESTS + ["assert True"]) == 0.0
  res = code.run_sandboxed("def f(x) return 2 * x\n", ["assert True"])
  assert (res.score, res.loaded, res.load_error) == (0.0, False, "SyntaxError")
  # A program that raises (or exits) while loading: no test runs, even one that would pass.
  assert code.score("def f(x):\n  return 2 * x\nraise SystemExit(0)\n", ["assert True"]) == 0.0
  # A test that is itself not valid Python fails alone.
  assert code.score(GOOD, TESTS + ["assert f(1) =="]) == pytest.approx(3 / 4)
  # `if __name__ == "__main__":` blocks (stdin readers) are skipped.
  main = GOOD + "if __name__ == '__main__':\n  print(f(int(input())))\n"
  assert code.score(main, TESTS) == 1.0


def test_fenced_block_extraction():
  wrong, right = "def f(x):\n  return 0\n", GOOD
  text = f"Draft:\n```python\n{wrong}```\nFinal:\n```python\n{right}```\n"
  assert code.extract_program(text) == right  # the LAST python block
  assert code.score(text, TESTS) == 1.0
  assert code.extract_program(f"```py\n{wrong}```\n```\n{right}```") == right  # untagged
  assert code.extract_program(f"```python\n{right}```\n```bash\nls -la\n```") == right
  assert code.extract_program("```text\nnot code\n```") == "```text\nnot code\n```"
  assert code.extract_program(f"intro\n```python3\n{right}") == right  # cut off: to the end
  assert code.extract_program(right) == right
  assert code.extract_program("```Python extra words\nx = 1\n```") == "x = 1\n"


def test_each_test_gets_its_share_of_the_time():
  # An endless test does not take the others down with it: per-test SIGALRM.
  spin = GOOD + "def spin():\n  while True:\n    pass\n"
  t0 = time.monotonic()
  res = code.run_sandboxed(spin, [TESTS[0], "spin()", TESTS[1]], timeout_sec=1.5)
  took = time.monotonic() - t0
  assert res.score == pytest.approx(2 / 3), res.test_errors
  assert res.test_errors == {1: "timeout"} and not res.timed_out
  assert took < 1.5 + SLACK


def _launchers():
  """This process's live sandbox launchers (another pytest worker's, e.g. the python tool's
  tests running beside this file under -n 2, are not this test's to count)."""
  out = []
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        launcher = f.read().endswith(b"rewards/sandbox_launcher.py\x00--launch\x00")
      with open(f"/proc/{pid}/stat", "rb") as f:
        parent = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError):
      continue
    if pid.isdigit() and launcher and parent == os.getpid():
      out.append(int(pid))
  return out


def test_a_callers_alarm_interrupts_cleanly(monkeypatch):
  """The reward computer's in-process timeout (a repeating SIGALRM) may land anywhere in a run:
  the run stops early, cleans up (no process, no workdir left), then the caller's handler runs."""

  class Timeout(BaseException):
    pass

  def on_alarm(signum, frame):
    # Like the computer's handler, only a call in progress is interrupted: a re-fire after the
    # run was interrupted (in pytest, GC, or this test before the timer is cleared) is ignored.
    while frame is not None:
      if frame.f_code is code.run_sandboxed.__code__:
        raise Timeout()
      frame = frame.f_back

  code.sandbox_info()
  # The runs' workdirs go to a folder of this test's own (another pytest worker's sandboxes
  # write theirs to the shared temp dir meanwhile); readable by all, like /tmp, so a root
  # scorer's uid-65534 program can enter its workdir.
  private = tempfile.mkdtemp(prefix="grpo_alarm_test_")
  os.chmod(private, 0o755)
  monkeypatch.setattr(tempfile, "tempdir", private)
  previous = signal.signal(signal.SIGALRM, on_alarm)
  interrupted, t0 = 0, time.monotonic()
  try:
    for delay in [0.0001] + [0.001 * i for i in range(1, 25)] + [0.05, 0.1]:
      signal.setitimer(signal.ITIMER_REAL, delay, 0.002)  # re-fires, like the computer's timer
      try:
        code.run_sandboxed("while True:\n  pass\n", ["assert True"], timeout_sec=5)
      except Timeout:
        interrupted += 1
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
      assert signal.getsignal(signal.SIGALRM) is on_alarm
  finally:
    signal.signal(signal.SIGALRM, previous)
  print(
      f"\n[code_tests] {interrupted} runs interrupted by SIGALRM: "
      f"{time.monotonic() - t0:.2f}s in all"
  )
  assert interrupted == 27
  for _ in range(20):
    if not _launchers():
      break
    time.sleep(0.05)
  assert not _launchers()
  assert not os.listdir(private)  # every run's workdir removed
  os.rmdir(private)


# ---------------------------------------------------------------- registration and routing


def test_registered_reward_and_verl_routing():
  fn = registry.get("code_tests")
  square = "def f(x):\n  return x * x\n"
  completions = [fenced(GOOD), fenced(square), "no code at all", fenced(GOOD)]
  ground_truth = [TESTS, json.dumps(TESTS), TESTS, None]
  extra_info = [None, {}, None, {"tests": TESTS, "timeout_sec": 4}]
  t0 = time.monotonic()
  out = fn(
      ["q"] * 4,
      completions,
      ground_truth=ground_truth,
      data_source=["code"] * 4,
      extra_info=extra_info,
  )
  print(f"\n[code_tests] batch of 4: {time.monotonic() - t0:.2f}s")
  assert out == pytest.approx([1.0, 2 / 3, 0.0, 1.0])
  # verl's default routing: data_source code / code_generation; tests may sit in extra_info.
  assert scoring.default_compute_score("code", fenced(GOOD), TESTS) == 1.0
  assert scoring.default_compute_score(
      "code_generation", fenced(square), None, {"tests": TESTS}
  ) == pytest.approx(2 / 3)
  assert registry.get("verl_default")(
      ["q"], [fenced(GOOD)], ground_truth=[TESTS], data_source=["code"], extra_info=[None]
  ) == [1.0]
  with pytest.raises(ValueError, match="no test cases"):
    code.compute_score("code", fenced(GOOD), None, {})
  assert code.parse_tests({"test_list": TESTS}) == TESTS
  assert code.parse_tests("assert f(1) == 2") == ["assert f(1) == 2"]


# ------------------------------------------------------------------------- the sandbox suite

GUARDS = {
    "full": dict(namespaces="auto", audit=True),
    "os_only": dict(namespaces=True, audit=False),
    "audit_only": dict(namespaces=False, audit=True),
}


@pytest.fixture(params=list(GUARDS), scope="module")
def guards(request):
  info = code.sandbox_info()
  if request.param == "full":
    print(f"\n[sandbox] this machine: {json.dumps(info, sort_keys=True)}")
  if request.param == "os_only" and not (
      info.get("pidns") and info.get("netns") and info.get("readonly") and info.get("proc")
  ):
    pytest.skip(f"no PID/network/read-only mount namespaces here: {info.get('notes')}")
  return request.param


def _trainer_state():
  limits = {
      r: resource.getrlimit(r)
      for r in (
          resource.RLIMIT_AS,
          resource.RLIMIT_CPU,
          resource.RLIMIT_NPROC,
          resource.RLIMIT_FSIZE,
          resource.RLIMIT_NOFILE,
      )
  }
  with open("/proc/self/mountinfo") as f:
    mounts = f.read()
  return (
      limits,
      os.getcwd(),
      os.readlink("/proc/self/ns/mnt"),
      os.readlink("/proc/self/ns/net"),
      mounts,
      os.geteuid(),
      signal.getsignal(signal.SIGALRM),
      signal.getsignal(signal.SIGINT),
  )


def _leftovers(res):
  """Processes still in the sandbox's session / process group, or in its PID namespace."""
  host_ns = os.readlink("/proc/self/ns/pid")
  ns = res.mode.get("pidns_id")
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
      if res.launcher_pid in (int(fields[2]), int(fields[3])):
        found.append((int(name), "session/group", fields[0]))
      elif ns and ns != host_ns and os.readlink(f"/proc/{name}/ns/pid") == ns:
        found.append((int(name), "pid namespace", fields[0]))
    except OSError:
      continue
  return found


def run(guards, case, program, tests, *, expect, timeout=3.0):
  """One contained run: the expected score, in time, no leftovers, the trainer unaffected."""
  before = _trainer_state()
  res = code.run_sandboxed(program, tests, timeout_sec=timeout, **GUARDS[guards])
  print(
      f"\n[sandbox {guards:>10}] {case:<16} score={res.score:.3f} elapsed={res.elapsed:.2f}s "
      f"timed_out={res.timed_out} errors={res.test_errors} load_error={res.load_error}"
  )
  assert res.setup_error is None, res.setup_error
  assert res.score == pytest.approx(expect), (res, res.test_errors, res.mode)
  assert res.elapsed < timeout + SLACK
  for _ in range(20):  # without a PID namespace, killed processes may still be reaped by init
    left = _leftovers(res)
    if not left:
      break
    time.sleep(0.05)
  assert not left, left
  assert not os.path.exists(res.workdir)
  assert _trainer_state() == before  # rlimits, cwd, namespaces, mount table, uid, handlers
  return res


def test_infinite_loop(guards):
  res = run(guards, "infinite loop", "while True:\n  pass\n", TESTS, expect=0.0, timeout=1.0)
  assert res.load_error == "timeout"
  # One that swallows the per-test alarm: the wall clock ends it; tests reported so far count.
  stubborn = GOOD + (
      "def stubborn():\n  while True:\n    try:\n      while True:\n        pass\n"
      "    except BaseException:\n      pass\n"
  )
  res = run(
      guards,
      "stubborn loop",
      stubborn,
      [TESTS[0], "stubborn()", TESTS[1]],
      expect=1 / 3,
      timeout=1.0,
  )
  assert res.timed_out and res.elapsed >= 0.9


FORK_BOMB = GOOD + """
import os, time
def bomb(seconds):
  made, end = 0, time.time() + seconds
  while time.time() < end:
    try:
      if os.fork() == 0:
        while True:
          pass
      made += 1
    except OSError:
      pass
  return made

def spawn(n):
  import subprocess
  made = 0
  for _ in range(n):
    try:
      subprocess.Popen(["/bin/sleep", "1000"])
      made += 1
    except OSError:
      pass
  return made
"""


def test_fork_bomb(guards):
  res = run(
      guards,
      "fork bomb",
      FORK_BOMB,
      [TESTS[0], "assert bomb(0.5) > 100", "assert spawn(100) >= 100"],
      expect=1 / 3,
  )
  assert set(res.test_errors) == {1, 2}


def test_memory_bomb(guards):
  program = GOOD + "def hog():\n  return bytearray(10 * 2**30)\n"
  run(
      guards,
      "memory bomb",
      program,
      [TESTS[0], "assert len(hog()) > 0", "x = [0] * (10 * 2**30 // 8)", TESTS[1]],
      expect=2 / 4,
  )


def test_writing_outside_its_directory(guards, tmp_path):
  token = secrets.token_hex(4)
  outside = [
      str(tmp_path / "escape.txt"),
      os.path.join(os.path.expanduser("~"), f"grpo_escape_{token}"),
      os.path.join(os.getcwd(), f"grpo_escape_{token}"),  # the trainer's cwd
      f"/tmp/grpo_escape_{token}",
  ]
  if os.path.isdir("/dev/shm"):
    outside.append(f"/dev/shm/grpo_escape_{token}")
  program = """
import os
def try_write(path):
  try:
    with open(path, "w") as f:
      f.write("escaped")
    return True
  except OSError:
    return False

def try_os_open(path):
  try:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    return True
  except OSError:
    return False
"""
  tests = (
      [f"assert try_write({p!r})" for p in outside]
      + [f"assert try_os_open({p + '_os'!r})" for p in outside]
      + ["assert try_write('inside.txt')", "assert open('inside.txt').read() == 'escaped'"]
  )
  try:
    run(guards, "write outside", program, tests, expect=2 / len(tests))
  finally:
    leaked = [p for p in outside + [p + "_os" for p in outside] if os.path.exists(p)]
    for p in leaked:
      os.remove(p)
  assert not leaked


def test_reading_the_parents_environment(guards, monkeypatch):
  monkeypatch.setenv("GRPO_TEST_SECRET", "s3cr3t")
  program = """
import os
def environ_of(pid):
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      return f.read()
  except OSError:
    return b""
"""
  run(
      guards,
      "parent env",
      program,
      [
          "assert True",
          "assert 'GRPO_TEST_SECRET' in os.environ",
          # passes: the sandbox's own env (LC_CTYPE is Python's PEP 538 locale coercion)
          "assert set(os.environ) <= {'HOME', 'TMPDIR', 'LC_CTYPE'}",
          f"assert b'GRPO_TEST_SECRET' in environ_of({os.getpid()})",
          "assert b'GRPO_TEST_SECRET' in environ_of(os.getppid())",
      ],
      expect=2 / 5,
  )


def test_opening_a_socket(guards):
  srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  srv.bind(("127.0.0.1", 0))
  srv.listen(8)
  srv.setblocking(False)
  port = srv.getsockname()[1]
  program = f"""
def connect():
  import socket
  s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
  s.sendall(b"pwned")
  return True
"""
  try:
    res = run(guards, "socket", program, ["assert True", "assert connect()"], expect=1 / 2)
    with pytest.raises(BlockingIOError):
      srv.accept()  # nobody ever connected
  finally:
    srv.close()
  # blocked by the audit hook / no route in the network namespace / (fallback as root with a
  # standard library closed to uid 65534) socket not importable
  assert res.test_errors[1] in ("PermissionError", "OSError", "ModuleNotFoundError")


def test_killing_its_parent(guards):
  # The audit hook refuses both. Without it, in a PID namespace the trainer's pid does not
  # exist, and getppid() is 0: kill(0, ...) signals the program's own process group, i.e.
  # itself as PID 1, which ignores it -- the launcher is in another group, out of sight. So the
  # statement "succeeds" and harms nothing; the trainer is never reachable.
  me = os.getpid()
  program = "import os, signal, time\n"
  expect = 2 / 3 if guards == "os_only" else 1 / 3
  run(
      guards,
      "kill parent",
      program,
      [
          "assert True",
          f"os.kill({me}, signal.SIGKILL)",
          "os.kill(os.getppid(), signal.SIGKILL); time.sleep(0.5)",
      ],
      expect=expect,
  )
  assert os.getpid() == me  # still here


def test_huge_stdout(guards):
  program = """
import sys
def flood(mib):
  chunk = "x" * (1 << 20)
  for _ in range(mib):
    sys.stdout.write(chunk)
    sys.stderr.write(chunk)
  sys.stdout.flush()
  return True
"""
  run(
      guards,
      "1 GiB stdout",
      program,
      ["assert True", "assert flood(1024)"],
      expect=1.0,
      timeout=5.0,
  )
