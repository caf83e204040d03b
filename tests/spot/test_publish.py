from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from tests.drafter.conftest import make_drafter
from tlt_lightning.models import HFTarget
from tlt_lightning.spot import DrafterPublisher


def fill(drafter, value: float) -> None:
    with torch.no_grad():
        for p in drafter.parameters():
            p.fill_(value)


def values(drafter) -> set[float]:
    return {float(v) for p in drafter.parameters() for v in p.detach().flatten()[:4]}


def test_publish_and_acquire_versions(llama):
    d = make_drafter(llama)
    pub = DrafterPublisher(d)
    with pub.acquire() as lease:
        version, served = lease
        assert version == 0 and served is not d
        assert served.fc.weight.equal(d.fc.weight) and not served.training
        assert not any(p.requires_grad for p in served.parameters())
        assert served._refs.embedding is d._refs.embedding  # the target is shared, not copied
    fill(d, 1.0)
    assert pub.publish(d) == 1 and pub.version == 1
    fill(d, 2.0)  # the trainer keeps going: published weights do not move
    with pub.acquire() as lease:
        assert lease.version == 1 and values(lease.drafter) == {1.0}
    assert pub.publish(d.state_dict()) == 2
    assert pub.state_dict() == {"version": 2, "published": 2}


def test_held_version_never_changes_and_publish_never_waits(llama):
    d = make_drafter(llama)
    pub = DrafterPublisher(d)
    fill(d, 1.0)
    pub.publish(d)
    lease = pub.acquire()  # a rollout on version 1
    for v in (2.0, 3.0, 4.0):
        fill(d, v)
        pub.publish(d)
    assert values(lease.drafter) == {1.0} and lease.version == 1
    assert pub.num_instances == 3  # the held one, the front, one spare
    with pub.acquire() as newest:
        assert newest.version == 4 and values(newest.drafter) == {4.0}
    lease.release()
    lease.release()  # idempotent
    assert pub.num_instances == 2  # back to double buffering


def test_concurrent_publisher_and_reader(llama):
    """A trainer thread publishes as fast as it can while rollouts check their weights never move."""
    d = make_drafter(llama)
    fill(d, 0.0)
    pub = DrafterPublisher(d)
    stop = threading.Event()
    errors: list[str] = []

    def trainer():
        version = 0
        while not stop.is_set():
            version += 1
            fill(d, float(version))  # the in-place "optimizer step"
            if pub.publish(d) != version:
                errors.append(f"publish did not return version {version}")

    thread = threading.Thread(target=trainer)
    thread.start()
    seen = []
    try:
        for _ in range(40):
            with pub.acquire() as lease:
                seen.append(lease.version)
                first = values(lease.drafter)
                if first != {float(lease.version)}:
                    errors.append(f"version {lease.version} served weights {first}")
                for _ in range(3):  # the "rollout": weights must stay put while the trainer publishes
                    time.sleep(0.002)
                    if values(lease.drafter) != first:
                        errors.append(f"version {lease.version} changed mid-rollout")
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors[:3]
    assert seen == sorted(seen) and seen[-1] > seen[0]  # monotonic, and the trainer made progress
    assert pub.num_instances == 2


def test_errors_and_resume(llama):
    d = make_drafter(llama)
    with pytest.raises(TypeError, match="drafter must be a Drafter"):
        DrafterPublisher("not a drafter")
    pub = DrafterPublisher(d)
    with pytest.raises(TypeError, match="weights must be a Drafter or a state_dict, got int"):
        pub.publish(3)
    with pytest.raises(
        ValueError, match=r"published weights do not fit the drafter: missing \['fc.weight'\]"
    ):
        pub.publish({k: v for k, v in d.state_dict().items() if k != "fc.weight"})
    bad = dict(d.state_dict(), **{"fc.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"published fc.weight has shape \[3, 3\]"):
        pub.publish(bad)
    assert pub.version == 0
    resumed = DrafterPublisher(d)
    resumed.load_state_dict({"version": 7})
    resumed.load_state_dict({})  # missing keys are tolerated
    assert resumed.version == 7 and resumed.publish(d) == 8


def test_serving_copies_on_a_bf16_mirror(llama):
    """An fp32 trainer drafter publishes into bf16 instances that read the mirror's embedding and head."""
    mirror = HFTarget(copy.deepcopy(llama.model).to(torch.bfloat16))
    d = make_drafter(llama, draft_vocab_size=64)
    d.set_draft_vocab(torch.arange(llama.info.vocab_size).flip(0))  # not the default first ids
    pub = DrafterPublisher(d, serving_target=mirror)
    fill(d, 0.5)
    pub.publish(d)
    with pub.acquire() as lease:
        served = lease.drafter
        assert served.dtype == torch.bfloat16 and d.dtype == torch.float32
        assert served._refs.head is mirror.model.get_output_embeddings()
        assert values(served) == {0.5} and torch.equal(served.draft_ids, d.draft_ids)
        assert not served.training and not any(p.requires_grad for p in served.parameters())
    # The copy drafts: its logits come from the mirror's bf16 head rows of the draft vocabulary.
    logits = served.logits(torch.randn(2, llama.info.hidden_size))
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 64)
