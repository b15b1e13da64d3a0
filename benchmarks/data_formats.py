r"""Reading the same rows as JSONL, verl's parquet and a Hugging Face datasets folder.

    python benchmarks/data_formats.py                  # 100k rows (~1 min on 2 cores)
    python benchmarks/data_formats.py --rows=20000 --repeats=1

The rows are GSM8K's train split repeated to --rows in verl's layout (data_source, prompt as a
list of chat messages, ability, reward_model {style, ground_truth}, extra_info {split, index,
answer, question}), written once as a JSONL prompt file (`data.train_source=jsonl`: the same
fields, ground_truth at the top), as parquet (`parquet`) and with `Dataset.save_to_disk`
(`hf_dataset`). Each format is read by the loop's reader (grpo_jax.data.load_rows' readers) in
its own fresh process, --repeats times: the median read time, and memory from the process's
resident set: before reading (imports done), its peak while reading and after (rows held).
`peak - after` is what the read needed beyond the rows it returns: a reader that held the
whole file's table beside the rows would show about the table's size there.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_mb() -> tuple[float, float]:
  """(current, peak) resident set of this process, MB (Linux /proc)."""
  cur = peak = 0.0
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        cur = int(line.split()[1]) / 1024
      elif line.startswith("VmHWM:"):
        peak = int(line.split()[1]) / 1024
  return cur, peak


def _reset_peak():
  try:  # Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass


def _child(kind: str, path: str, repeats: int):
  from grpo_jax.data import datasets as readers
  from grpo_jax.data import tables
  import pyarrow  # noqa: F401  (imports before the baseline)

  if kind == "hf_dataset":
    import datasets  # noqa: F401
  read = {
      "jsonl": lambda: readers.read_prompt_file(path),
      "parquet": lambda: tables.read_parquet(path),
      "hf_dataset": lambda: tables.read_hf_dataset(path),
  }[kind]
  times, mem = [], None
  for i in range(repeats):
    _reset_peak()
    before, _ = _rss_mb()
    t0 = time.perf_counter()
    rows = read()
    times.append(time.perf_counter() - t0)
    after, peak = _rss_mb()
    if i == 0:
      mem = dict(before=before, peak=peak, after=after)
    n = len(rows)
    del rows
  print(json.dumps(dict(kind=kind, rows=n, seconds=sorted(times)[len(times) // 2], **mem)))


def _records(n: int) -> list[dict]:
  from tests.data import tables_fixtures as fx

  base = fx.verl_gsm8k_records("train", 7473)
  return [
      dict(base[i % len(base)], extra_info=dict(base[i % len(base)]["extra_info"], index=i))
      for i in range(n)
  ]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=100_000)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--dir", default="", help="where to write the files (default: a temp dir)")
  ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return _child(*args.child, args.repeats)

  import datasets
  from tests.data import tables_fixtures as fx

  folder = args.dir or tempfile.mkdtemp(prefix="grpo_data_formats_")
  os.makedirs(folder, exist_ok=True)
  records = _records(args.rows)
  paths = {
      "jsonl": os.path.join(folder, "train.jsonl"),
      "parquet": os.path.join(folder, "train.parquet"),
      "hf_dataset": os.path.join(folder, "train_ds"),
  }
  with open(paths["jsonl"], "w") as f:  # our prompt-file layout: ground_truth at the top
    for r in records:
      f.write(
          json.dumps(
              dict(
                  prompt=r["prompt"],
                  ground_truth=r["reward_model"]["ground_truth"],
                  data_source=r["data_source"],
                  ability=r["ability"],
                  extra_info=r["extra_info"],
              )
          )
          + "\n"
      )
  fx.write_parquet(records, paths["parquet"])
  datasets.disable_progress_bars()
  datasets.Dataset.from_list(records).save_to_disk(paths["hf_dataset"])
  del records

  def size(p):
    if os.path.isdir(p):
      return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
    return os.path.getsize(p)

  print(
      f"{args.rows} rows of GSM8K in verl's layout; {args.repeats} reads each, fresh process "
      "per format\n"
  )
  print(
      "| format | file MB | read s (median) | rows/s | RSS before MB | peak MB | after MB | "
      "peak - after MB |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  results = {}
  for kind, p in paths.items():
    out = subprocess.run(
        [sys.executable, __file__, f"--repeats={args.repeats}", "--child", kind, p],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if out.returncode:
      print(f"| {kind} | failed: {out.stderr.strip().splitlines()[-1]} |")
      continue
    r = json.loads(out.stdout.strip().splitlines()[-1])
    results[kind] = r
    print(
        f"| {kind} | {size(p) / 1e6:.1f} | {r['seconds']:.2f} | {r['rows'] / r['seconds']:,.0f} "
        f"| {r['before']:.0f} | {r['peak']:.0f} | {r['after']:.0f} | "
        f"{r['peak'] - r['after']:.0f} |"
    )
  if "jsonl" in results:
    for kind in ("parquet", "hf_dataset"):
      if kind in results:
        print(
            f"\n{kind} / jsonl read time: "
            f"{results[kind]['seconds'] / results['jsonl']['seconds']:.2f}x"
        )


if __name__ == "__main__":
  main()
