"""TensorBoard's own reader on the event files of a `train` run (the `clients` step of
`cargo xtask test`; `cargo xtask python` installs TensorBoard).

    python examples/python/check_tensorboard.py DIR

DIR holds `tensorboard/` (the run's `--tensorboard` folder) and `metrics.jsonl` (its
`--metrics` file), as `tests/train_cli.rs` leaves them with BONFIRE_KEEP_TENSORBOARD=DIR.
TensorBoard's `EventAccumulator` must read, for every step of the metrics file, the same
`train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s` and `train/peak_rss_bytes`
(as float32, the type of an event's simple value), and the evaluation losses the run printed
under `eval/loss`. Exits non-zero naming the first difference.
"""

import json
import pathlib
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FIELDS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "train/tokens_per_s": "tokens_per_s",
    "train/peak_rss_bytes": "peak_rss_bytes",
}


def main(folder):
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert metrics, "the metrics file is empty"
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag, field in FIELDS.items():
        assert tag in tags, f"TensorBoard reads no {tag} (it reads {sorted(tags)})"
        got = {e.step: e.value for e in events.Scalars(tag)}
        for m in metrics:
            want = np.float32(m[field])
            assert m["step"] in got, f"{tag}: no value at step {m['step']}"
            assert np.float32(got[m["step"]]) == want, f"{tag} step {m['step']}: {got[m['step']]} != {want}"
    evals = events.Scalars("eval/loss")
    assert evals, "TensorBoard reads no eval/loss"
    print(
        f"tensorboard: {len(metrics)} steps x {len(FIELDS)} scalars and "
        f"{len(evals)} eval losses read back"
    )


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
