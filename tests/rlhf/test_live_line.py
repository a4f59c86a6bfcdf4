"""The live line of `python -m rlhf.train`: a value not measured yet reads '–', never 'nan'."""

import io

from rlhf.metrics import ConsoleProgress


def test_the_first_live_line_has_no_nan():
    stream = io.StringIO()
    progress = ConsoleProgress(total_steps=4, stream=stream)
    progress.write({"step": 0, "eval/accuracy": 0.27})  # the initial evaluation: no reward, KL or step time yet
    progress.write({"step": 1, "reward_mean": 0.5, "kl_divergence": 0.01})
    first, second = stream.getvalue().splitlines()
    assert first == "step 0/4 | reward – | KL – | eval acc 0.270 | ETA –s", first
    assert "nan" not in second and second.startswith("step 1/4 | reward 0.500 | KL 0.0100 | eval acc 0.270 | ETA")
