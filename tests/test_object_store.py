"""Checkpoints on an object store (s3:// through tensorstore's kvstore), against a local S3
server the tests start (moto's), never a mock of our own.

Every rank writes its own shard straight to the store; a checkpoint counts once its commit
file is written, last: one without it is neither listed nor restored, and a later save of
that step replaces it. Checksums, retention, asynchronous saves, restore onto another layout
and ``python -m funcshard inspect / verify`` work there as on a path. The manager lists its
steps from a small index (never every object), sweeps what killed saves left, and a failure
after the commit (retention) never touches the committed step. A missing bucket raises on
every rank, naming it; an endpoint that does not answer fails within a bounded time.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

import funcshard as fs
from funcshard.checkpoint import cli, storage
from funcshard.distributed.launch import free_port
from funcshard.testing import local_s3

import models
from helpers_errors import error_text
from helpers_kill import kill_trials

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "funcshard-test"
ROWS = 37


@pytest.fixture(scope="module")
def s3() -> dict:
    """A local S3 server and a bucket; the environment a rank needs to reach it."""
    with local_s3(BUCKET) as env:
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
        yield {"env": env, "client": client}


def _keys(s3: dict, prefix: str) -> list[str]:
    pages = s3["client"].get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _opt() -> fs.optim.Optimizer:
    return fs.optim.sgd(0.1, momentum=0.9)


def save_worker(env: dict, url: str, steps: int) -> dict:
    os.environ.update(env)
    models.save_trained(url, _opt, seed=3, steps=steps, rows=ROWS)
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=3)
    state = fs.init(model, _opt(), mesh=mesh, strategy="optim_grads_params", offload_fraction=0.5)
    state, _ = models.train(state, model, range(steps), rows=ROWS)
    return fs.full_params(state)


def resume_worker(env: dict, url: str, strategy: str, start: int, stop: int) -> dict:
    os.environ.update(env)
    return models.resume_trained(url, _opt, strategy, 0.0, start=start, stop=stop, rows=ROWS)


def test_a_save_to_s3_restores_onto_another_layout_bitwise(s3, pool2, pool1) -> None:
    url = f"s3://{BUCKET}/layouts/ckpt"
    trained = pool2.run(save_worker, s3["env"], url, 2)[0]
    keys = _keys(s3, "layouts/ckpt/")
    assert "layouts/ckpt/commit_success.txt" in keys and "layouts/ckpt/_CHECKSUMS" in keys
    # both ranks wrote their own rows: the chunk objects of a leaf come from both
    resumed = pool1.run(resume_worker, s3["env"], url, "no_shard", 2, 2)[0]
    for name, t in trained.items():
        assert torch.equal(resumed[name], t), name
    # the same restore read from a local copy gives the same bits
    again = pool2.run(resume_worker, s3["env"], url, "optim_grads", 2, 3)
    assert all(torch.equal(again[0][n], again[1][n]) for n in again[0])


class _Listed:
    """Counts the keys this process's object-store listings return (storage's one lister)."""

    def __init__(self) -> None:
        self.keys, self._real = 0, storage._keys_under

    def __enter__(self) -> _Listed:
        def counting(path: str) -> list[str]:
            keys = self._real(path)
            self.keys += len(keys)
            return keys

        storage._keys_under = counting
        return self

    def __exit__(self, *exc: object) -> None:
        storage._keys_under = self._real


def manager_worker(env: dict, root: str) -> dict:
    os.environ.update(env)
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=5)
    state = fs.init(model, _opt(), mesh=mesh, strategy="optim")
    listed_by_save = []
    with fs.CheckpointManager(root, max_to_keep=2) as mgr:  # asynchronous saves
        for step in range(3):
            state, _ = models.train(state, model, [step], rows=ROWS)
            with _Listed() as listed:
                mgr.save(state.step, state)
                mgr.wait()
            listed_by_save.append(listed.keys)
        with _Listed() as listed:
            latest = mgr.latest_step()
        steps = mgr.all_steps()
        restored = mgr.restore(like=fs.init(model, _opt(), mesh=mesh, strategy="optim"))
    return {
        "steps": steps,
        "latest": latest,
        "listed_by_save": listed_by_save,
        "listed_by_latest": listed.keys,
        "same": all(
            torch.equal(a, b)
            for a, b in zip(
                fs.full_params(state).values(), fs.full_params(restored).values(), strict=True
            )
        ),
    }


def test_the_manager_keeps_and_lists_committed_steps_only(s3, pool2) -> None:
    root = f"s3://{BUCKET}/managed"
    # a killed save of step 9 left objects but no commit file: never listed
    s3["client"].put_object(Bucket=BUCKET, Key="managed/9/default/_METADATA", Body=b"{}")
    results = pool2.run(manager_worker, s3["env"], root)
    for result in results:
        assert result["steps"] == [2, 3] and result["same"], result
    keys = _keys(s3, "managed/")
    # the steps are listed from the index (a key a step), not from every object of the root:
    # latest_step() lists as many keys as there are steps, a save on rank 0 a few times that
    assert results[0]["listed_by_latest"] == len(results[0]["steps"]) + 1, results[0]  # + whole
    per_step = sum(k.startswith("managed/3/") for k in keys)
    bound = 3 * (2 + 2)  # three listings of an index of max_to_keep + 1 steps, + whole
    assert per_step > bound and max(results[0]["listed_by_save"]) <= bound, (per_step, results)
    assert not any(k.startswith("managed/1/") for k in keys), "retention"
    assert not any(k.startswith("managed/9/") for k in keys), "the killed save's objects"


def retention_failure_worker(env: dict, root: str) -> dict:
    """max_to_keep=1; retention's removal of step 1 fails (the store removed its commit file,
    then the request failed): step 2, committed, stands; the next save's sweep of step 1 fails
    too: its index entry stays (else its objects were never swept); the one after sweeps it."""
    os.environ.update(env)
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=7)
    state = fs.init(model, _opt(), mesh=mesh, strategy="optim")
    mgr = fs.CheckpointManager(root, max_to_keep=1, async_save=False)
    mgr.save(1, state)
    state, _ = models.train(state, model, [0], rows=ROWS)
    real = storage.remove_file

    def removed_then_failed(path: str) -> None:
        real(path)
        if path.endswith("/1/commit_success.txt"):
            raise OSError(f"{path}: the request timed out (injected)")

    storage.remove_file = removed_then_failed
    try:
        error = error_text(lambda: mgr.save(2, state))
    finally:
        storage.remove_file = real
    after_failure = mgr.all_steps()
    like = fs.init(models.make_model(seed=8), _opt(), mesh=mesh, strategy="optim")
    restored = fs.full_params(mgr.restore(like=like))
    same = all(torch.equal(restored[n], t) for n, t in fs.full_params(state).items())
    real_tree = storage.remove_tree

    def sweep_fails(path: str) -> None:  # the next save's sweep of step 1 fails: kept indexed
        if path.endswith("/1"):
            raise OSError(f"{path}: the request timed out (injected)")
        real_tree(path)

    storage.remove_tree = sweep_fails
    try:
        mgr.save(3, state)
    finally:
        storage.remove_tree = real_tree
    indexed = storage.listdir(f"{root}/_funcshard_steps")
    mgr.save(4, state)  # sweeps step 1 now
    return {
        "error": error,
        "after_failure": after_failure,
        "same": same,
        "indexed": indexed,
        "end": mgr.all_steps(),
    }


def test_a_retention_failure_never_touches_the_committed_step(s3, pool2) -> None:
    root = f"s3://{BUCKET}/retention"
    for r in pool2.run(retention_failure_worker, s3["env"], root):
        assert r["error"] is None, r  # the save committed: retention's failure is logged
        assert r["after_failure"] == [2] and r["same"] and r["end"] == [4], r
        assert r["indexed"] == ["1", "3", "whole"], r
    assert not any(k.startswith("retention/1/") for k in _keys(s3, "retention/")), "swept"


def cut_indexing_worker(env: dict, root: str) -> dict:
    """A root of an older funcshard (steps 1 and 2, no index); the save that indexes it fails
    after entering step 1 only. The index is not trusted until whole: step 2 stays listed."""
    os.environ.update(env)
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(models.make_model(seed=7), _opt(), mesh=mesh, strategy="optim")
    for step in (1, 2):
        fs.save(f"{root}/{step}", state)  # no manager: no index, as an older funcshard
    mgr = fs.CheckpointManager(root, max_to_keep=2, async_save=False)
    real, entered = storage.write_bytes, []

    def second_fails(path: str, data: bytes) -> None:
        if "/_funcshard_steps/" in path:
            entered.append(path)
            if len(entered) == 2:
                raise OSError(f"{path}: the request timed out (injected)")
        real(path, data)

    storage.write_bytes = second_fails
    try:
        error = error_text(lambda: mgr.save(3, state))
    finally:
        storage.write_bytes = real
    after_failure = fs.CheckpointManager(root, max_to_keep=2).all_steps()
    mgr.save(3, state)
    return {"error": error, "after_failure": after_failure, "end": mgr.all_steps()}


def test_an_indexing_cut_short_loses_no_step_of_an_older_root(s3, pool1) -> None:
    root = f"s3://{BUCKET}/older"
    r = pool1.run(cut_indexing_worker, s3["env"], root)[0]
    assert r["error"] is not None and "injected" in r["error"], r
    assert r["after_failure"] == [1, 2] and r["end"] == [2, 3], r
    assert not any(k.startswith("older/1/") for k in _keys(s3, "older/")), "retention"


def missing_bucket_worker(env: dict) -> list[str | None]:
    os.environ.update(env)
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=9)
    state = fs.init(model, _opt(), mesh=mesh, strategy="optim")
    url = "s3://no-such-bucket-52/run"
    like = fs.init(model, _opt(), mesh=mesh, strategy="optim")
    return [
        error_text(lambda: fs.save(f"{url}/1", state)),
        error_text(lambda: fs.restore(f"{url}/1", like=like)),
        error_text(lambda: fs.CheckpointManager(url)),
    ]


def test_a_missing_bucket_raises_on_every_rank_naming_it(s3, pool2) -> None:
    for rank, errors in enumerate(pool2.run(missing_bucket_worker, s3["env"])):
        for error in errors:  # every rank, never a collective's timeout
            assert error is not None and "no-such-bucket-52" in error, (rank, error)
            assert "NoSuchBucket" in error, (rank, error)


def _within(seconds: float, fn) -> str | None:
    """``fn``'s error text, failing the test if it has not returned after ``seconds``."""
    out: list[str | None] = []
    thread = threading.Thread(target=lambda: out.append(error_text(fn)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still retrying after {seconds} s"
    return out[0]


def test_an_endpoint_that_does_not_answer_fails_fast_naming_it(s3, monkeypatch) -> None:
    # the probe's deadline and retry budget, 10 s by default, cut to 2 s: the test waits each
    # out once (20 s of the suite's time before); the message names the deadline in force
    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 2.0)
    silent = socket.socket()  # accepts connections (the kernel does), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    with silent:
        hung = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", hung)
        error = _within(120, lambda: fs.CheckpointManager(f"s3://{BUCKET}/silent"))
        assert error is not None and "did not answer within 2 s" in error and hung in error, error
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    began = time.monotonic()
    error = _within(120, lambda: fs.CheckpointManager(f"s3://{BUCKET}/dead"))
    assert error is not None and "StoreError" in error and dead in error, error
    assert BUCKET in error, error
    probed = time.monotonic() - began
    monkeypatch.setenv(storage.TIMEOUT_ENV, "2")  # a write: the configured budget
    error = _within(120, lambda: storage.write_bytes(f"s3://{BUCKET}/dead/x", b"x"))
    assert error is not None and dead in error and "Could not connect" in error, error
    assert probed < 60, probed  # PROBE_TIMEOUT_S of retries, not the 60 s budget nor 15 minutes
    monkeypatch.setenv(storage.TIMEOUT_ENV, "zero")
    with pytest.raises(ValueError, match=storage.TIMEOUT_ENV):
        storage.retry_budget()


def partial_worker(env: dict, url: str) -> str:
    os.environ.update(env)
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=6)
    like = fs.init(model, _opt(), mesh=mesh, strategy="optim_grads_params")
    try:
        fs.restore(url, like=like)
    except FileNotFoundError as e:  # on every rank, before anything is read
        return str(e)
    return "restored"


def test_an_uncommitted_save_is_not_restored_and_a_new_save_replaces_it(s3, pool2) -> None:
    url = f"s3://{BUCKET}/partial/ckpt"
    pool2.run(save_worker, s3["env"], url, 1)
    s3["client"].delete_object(Bucket=BUCKET, Key="partial/ckpt/commit_success.txt")
    for message in pool2.run(partial_worker, s3["env"], url):
        assert "no committed checkpoint" in message, message
    trained = pool2.run(save_worker, s3["env"], url, 2)[0]  # replaces the partial one
    resumed = pool2.run(resume_worker, s3["env"], url, "optim", 2, 2)[0]
    assert all(torch.equal(resumed[n], t) for n, t in trained.items())


def test_inspect_and_verify_read_the_store_and_find_a_flipped_byte(s3, pool2, capsys) -> None:
    url = f"s3://{BUCKET}/verify/ckpt"
    pool2.run(save_worker, s3["env"], url, 1)
    assert cli.main(["inspect", url]) == 0
    assert "funcshard (Orbax layout)" in capsys.readouterr().out
    assert cli.main(["verify", url]) == 0
    chunk = next(k for k in _keys(s3, "verify/ckpt/params.") if k.rsplit("/", 1)[-1][0].isdigit())
    body = bytearray(s3["client"].get_object(Bucket=BUCKET, Key=chunk)["Body"].read())
    body[len(body) // 2] ^= 0x10
    s3["client"].put_object(Bucket=BUCKET, Key=chunk, Body=bytes(body))
    assert cli.main(["verify", url]) == 1
    assert "BAD" in capsys.readouterr().out


def test_object_urls_are_split_into_bucket_and_key() -> None:
    assert storage.is_object("s3://b/x") and storage.is_object("gs://b/x")
    assert not storage.is_object("/tmp/x") and storage.normalize("file:///tmp/x") == "/tmp/x"
    spec = storage.kvstore("gs://bucket/run/10")
    retries = spec.pop("context")["gcs_request_retries"]  # bounded by FUNCSHARD_STORE_TIMEOUT_S
    assert spec == {"driver": "gcs", "bucket": "bucket", "path": "run/10/"}
    assert 0 < retries["max_retries"] < 32, retries  # tensorstore's own: 32, about 15 minutes
    with pytest.raises(ValueError, match="names no bucket"):
        storage.kvstore("s3:///run")


# one by default: test_kill_restart.py runs the trials on paths; more to measure
S3_KILL_TRIALS = int(os.environ.get("FUNCSHARD_S3_KILL_TRIALS", "1"))


@pytest.mark.slow
def test_kill_during_an_s3_save_leaves_the_previous_step_restorable(s3, pool2, tmp_path) -> None:
    """The kill-during-save trials of test_kill_restart.py, the checkpoints on the store (the
    job inherits this process's environment: the server's endpoint)."""
    os.environ["FUNCSHARD_KILL_CKPT"] = f"s3://{BUCKET}/killed"
    try:
        kill_trials(
            pool2,
            str(tmp_path),
            {**s3["env"], "FUNCSHARD_KILL_CKPT": os.environ["FUNCSHARD_KILL_CKPT"]},
            trials=S3_KILL_TRIALS,
        )
    finally:
        del os.environ["FUNCSHARD_KILL_CKPT"]


def test_a_budget_of_days_is_a_bounded_count_of_retries(monkeypatch) -> None:
    """A budget past ~5 hours made the doubling backoff overflow a float (OverflowError on
    every request); infinity and NaN are refused like 0, a negative number or a word."""
    monkeypatch.setenv(storage.TIMEOUT_ENV, "86400")  # a day: waits of 16 s + 1 s of jitter
    retries = storage.kvstore(f"s3://{BUCKET}/x")["context"]["s3_request_retries"]
    assert 86400 / 17 < retries["max_retries"] < 86400 / 17 + 8, retries
    for bad in ("inf", "nan", "0", "-5", "abc"):
        monkeypatch.setenv(storage.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=storage.TIMEOUT_ENV):
            storage.kvstore(f"s3://{BUCKET}/x")
