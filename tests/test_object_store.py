"""Checkpoints on an object store (s3:// through tensorstore's kvstore), against a local S3
server the tests start (moto's), never a mock of our own.

Every rank writes its own shard straight to the store; a checkpoint counts once its commit
file is written, last: one without it is neither listed nor restored, and a later save of
that step replaces it. Checksums, retention, asynchronous saves, restore onto another layout
and ``python -m funcshard inspect / verify`` work there as on a path.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import funcshard as fs
from funcshard.checkpoint import cli, storage

import models
from helpers_kill import kill_trials

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "funcshard-test"
ROWS = 37


@pytest.fixture(scope="module")
def s3() -> dict:
    """A local S3 server and a bucket; the environment a rank needs to reach it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:  # this process's, for the module's tests only
        for k, v in env.items():
            mp.setenv(k, v)
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield {"env": env, "client": client}
        server.stop()


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


def manager_worker(env: dict, root: str) -> dict:
    os.environ.update(env)
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=5)
    state = fs.init(model, _opt(), mesh=mesh, strategy="optim")
    with fs.CheckpointManager(root, max_to_keep=2) as mgr:  # asynchronous saves
        for step in range(3):
            state, _ = models.train(state, model, [step], rows=ROWS)
            mgr.save(state.step, state)
        mgr.wait()
        steps = mgr.all_steps()
        restored = mgr.restore(like=fs.init(model, _opt(), mesh=mesh, strategy="optim"))
    return {
        "steps": steps,
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
    for result in pool2.run(manager_worker, s3["env"], root):
        assert result["steps"] == [2, 3] and result["same"], result
    assert not any(k.startswith("managed/1/") for k in _keys(s3, "managed/")), "retention"


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
    assert spec == {"driver": "gcs", "bucket": "bucket", "path": "run/10/"}
    with pytest.raises(ValueError, match="names no bucket"):
        storage.kvstore("s3:///run")


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
        )
    finally:
        del os.environ["FUNCSHARD_KILL_CKPT"]
