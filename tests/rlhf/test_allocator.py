"""The CUDA allocator settings the engine sets (rlhf/allocator.py): expandable segments unless
the user's environment says otherwise, passed on to the Ray ranks."""

import subprocess
import sys

from rlhf import allocator
from rlhf.placement.cluster import FORWARDED_ENV, forwarded_env
from tests.conftest import REPO


def test_expandable_segments_unless_the_user_set_the_variable():
    env = {}
    assert allocator.configure(env) == "expandable_segments:True" and allocator.expandable(env)
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert allocator.configure(mine) == "max_split_size_mb:512" and not allocator.expandable(mine)
    off = {"PYTORCH_CUDA_ALLOC_CONF": ""}  # set, even empty: the user's choice
    assert allocator.configure(off) == "" and not allocator.expandable(off)
    both = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8, expandable_segments:True"}
    assert allocator.expandable(both)


def test_the_ranks_get_the_setting():
    assert "PYTORCH_CUDA_ALLOC_CONF" in FORWARDED_ENV
    assert forwarded_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == \
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_the_engine_sets_it_before_cuda_starts():
    """`python -m rlhf.train` configures the allocator first thing (a bad recipe still exits 2 after it)."""
    code = ("import os, sys; os.environ.pop('PYTORCH_CUDA_ALLOC_CONF', None); from rlhf import train; "
            "rc = train.main(['no-such.gin', '--out', sys.argv[1]]); "
            "print(rc, os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "runs" / "never")], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.stdout.split() == ["2", "expandable_segments:True"], out.stderr[-2000:]
