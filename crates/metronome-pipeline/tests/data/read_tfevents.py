"""Reads the TensorBoard event files of a Metronome run directory with TensorBoard's
own reader and prints every scalar as a JSON line: {"tag", "step", "value"}.

    python3 read_tfevents.py runs/<name>

Used by crates/metronome-pipeline/tests/it/events.rs (which needs `pip install
tensorboard`; .ci/run installs it) to check that TensorBoard parses what Metronome
writes.
"""

import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            print(json.dumps({"tag": tag, "step": event.step, "value": event.value}))


if __name__ == "__main__":
    main()
