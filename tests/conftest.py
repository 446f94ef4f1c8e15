"""Test setup: one torch thread (several times faster for tiny models on a 2-core machine), the tiers'
markers checked, the one launch of the session's multi-process runs (tests/rank_jobs.py), and the vLLM
engines the session's tests share (tests/vllm_pool.py)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

from rank_jobs import JOBS, SOLO, RankJobs  # noqa: E402

# the first test that reads a multi-process job waits for the whole launch (every job the session needs)
LAUNCH_TIMEOUT = 1800
RANK_JOBS = pytest.StashKey[RankJobs]()
# CI (.ci/run) sets LRL_REQUIRE_VLLM=1: a vLLM test that is skipped, or a run with none selected, fails
VLLM_REQUIRED = os.environ.get("LRL_REQUIRE_VLLM") == "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("ranks")
        if marker is None:
            continue
        unknown = [name for name in marker.args if name not in JOBS and name not in SOLO]
        if unknown or item.get_closest_marker("distributed") is None:
            raise pytest.UsageError(f"{item.nodeid}: ranks{marker.args} needs the `distributed` marker and "
                                    f"names from tests/rank_jobs.py JOBS or SOLO (unknown: {unknown})")
        item.add_marker(pytest.mark.timeout(LAUNCH_TIMEOUT))


def pytest_collection_finish(session):
    """Refuse a CI run without the vLLM tests; start the launch of the multi-process jobs (below)."""
    if VLLM_REQUIRED and not any(item.get_closest_marker("vllm") for item in session.items):
        raise pytest.UsageError("LRL_REQUIRE_VLLM=1 but no `vllm` test is selected: the vLLM tests were "
                                "deselected")
    launch_rank_jobs(session)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if VLLM_REQUIRED and report.skipped and item.get_closest_marker("vllm") is not None:
        report.outcome = "failed"  # CI runs the vLLM tests or fails
        report.longrepr = f"LRL_REQUIRE_VLLM=1 and this vLLM test was skipped: {report.longrepr}"


def launch_rank_jobs(session):
    """Start the launch of the multi-process jobs the selected tests name, in the background: it runs
    while the single-process tests do (``LRL_TEST_LAUNCH=first-use`` waits for the first test that reads
    one, so that nothing else runs beside it)."""
    names = [name for item in session.items for m in item.iter_markers("ranks") for name in m.args]
    factory = getattr(session.config, "_tmp_path_factory", None)  # pytest's own (tmp_path's base folder)
    folder = factory.mktemp("ranks") if factory else Path(tempfile.mkdtemp(prefix="lightning-rl-ranks-"))
    jobs = RankJobs(folder, list(dict.fromkeys(names)))
    session.config.stash[RANK_JOBS] = jobs
    if os.environ.get("LRL_TEST_LAUNCH", "background") == "background":
        jobs.start()


@pytest.fixture(scope="session")
def rank_jobs(request) -> RankJobs:
    """The folders of the multi-process jobs that the selected tests name (one launch for the session)."""
    return request.config.stash[RANK_JOBS]


@pytest.fixture(scope="session")
def vllm_pool():
    """vLLM engines shared by the session's tests (tests/vllm_pool.py); skips where vLLM is not installed
    (a failure under LRL_REQUIRE_VLLM=1)."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        if VLLM_REQUIRED:
            pytest.fail(f"LRL_REQUIRE_VLLM=1 but vLLM does not import: {err}")
        pytest.skip(f"vLLM is not installed ({err})")
    from vllm_pool import Pool

    pool = Pool()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lightning_rl.step.vllm_engine.ColocatedLLM", pool)
        yield pool
    pool.close()


@pytest.fixture
def seeded_one_thread():
    """One torch thread and torch's global seed 0 for the test (files opt in with ``pytestmark``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored after it (a CLI run in-process may change it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
