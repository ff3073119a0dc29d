"""PredictorService with the embedded store: validation, hints per (model, pod), coalescing,
insertion at request end, retry while the store is down, expiry."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from predictor_svc.config import PredictorConfig
from predictor_svc.errors import BadActivation, ModelNotRegistered, StoreUnavailable
from predictor_svc.service import Activation, PredictorService
from predictor_svc.store import EmbeddedStore
from predictor_svc.subscriptions import Subscription, top_hints
from tests.threads import run_in_threads

L, E, K = 3, 8, 2


def act(
    request_id, token_index, experts=None, *, model="m", pod="p", done=False, num_experts=E, top_k=K, **kw
):
    if experts is None:
        experts = [(token_index + j + layer) % E for layer in range(L) for j in range(top_k)]
    return Activation(
        request_id, model, pod, token_index, experts, top_k, done, num_experts=num_experts, **kw
    )


SHAPES = (f"m={L}x{E}x{K}", f"n={L}x{E}x{K}")  # the models the tests use, configured


def make(store=None, **overrides) -> PredictorService:
    values = {
        "min_score": 0.0,
        "hint_top_n": 4,
        "sync_interval_s": 3600.0,
        "model_shapes": SHAPES,
        **overrides,
    }
    return PredictorService(PredictorConfig(**values), store or EmbeddedStore(), background=False)


class FlakyStore(EmbeddedStore):
    """The embedded store with a switch that makes every call fail like an unreachable Redis."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self):
        if self.down:
            raise StoreUnavailable("EAMC store redis://test is down")

    def load(self, model_id):
        self._check()
        return super().load(model_id)

    def entry_ids(self, model_id):
        self._check()
        return super().entry_ids(model_id)

    def get_many(self, model_id, entry_ids):
        self._check()
        return super().get_many(model_id, entry_ids)

    def refill(self, model_id, cursor, blobs, capacity):
        self._check()
        return super().refill(model_id, cursor, blobs, capacity)

    def changes(self, model_id, cursor, limit=0):
        self._check()
        return super().changes(model_id, cursor, limit)

    def insert(self, model_id, blob, capacity, victim_id):
        self._check()
        return super().insert(model_id, blob, capacity, victim_id)


def test_hints_reach_only_the_subscriber_of_that_model_and_pod():
    svc = make()
    mine, other_pod, other_model = svc.subscribe("m", "p"), svc.subscribe("m", "q"), svc.subscribe("n", "p")
    svc.observe(act("r1", 0))
    batch = mine.get(1.0)
    assert batch is not None and batch.request_id == "r1" and batch.token_index == 0
    # After one token the history predicts exactly that token's experts for every layer.
    for layer in range(L):
        hinted = {h.expert for h in batch.hints if h.moe_layer == layer}
        assert hinted == {(0 + j + layer) % E for j in range(K)}
    assert all(0.0 <= h.score <= 1.0 for h in batch.hints)
    assert other_pod.get(0.05) is None and other_model.get(0.05) is None
    stats = svc.stats()
    assert stats.queries == 1 and stats.subscribers == 3 and stats.hint_batches_published == 1


def test_no_subscriber_no_query():
    svc = make()
    svc.observe(act("r1", 0))
    assert svc.stats().queries == 0
    assert svc.stats().observed_tokens == 1


def test_newer_hints_replace_unsent_ones_per_layer():
    svc = make()
    sub = svc.subscribe("m", "p")
    for t in range(3):  # nobody reads: hints of tokens 0 and 1 are replaced layer by layer
        svc.observe(act("r1", t, [t % E] * (L * K)))
    batch = sub.get(1.0)
    assert batch.token_index == 2
    assert sorted({h.moe_layer for h in batch.hints}) == list(range(L))
    # One batch per request: nothing older left behind.
    assert sub.get(0.05) is None
    assert svc.stats().hints_replaced == 2 * L


def test_subscriber_queue_is_bounded_and_drops_oldest_request():
    svc = make(subscriber_queue_requests=2)
    sub = svc.subscribe("m", "p")
    for r in range(4):
        svc.observe(act(f"r{r}", 0))
    got = [sub.get(0.5).request_id for _ in range(2)]
    assert got == ["r2", "r3"]
    assert svc.stats().hints_dropped == 2 * L
    assert sub.get(0.05) is None


def test_hints_with_low_scores_are_filtered():
    scores = np.array([[0.9, 0.1, 0.5, 0.0], [0.0, 0.0, 0.0, 0.2]], dtype=np.float32)
    out = top_hints(scores, top_n=2, min_score=0.15)
    assert [(h.expert, h.score) for h in out[0]] == [(0, pytest.approx(0.9)), (2, pytest.approx(0.5))]
    assert [h.expert for h in out[1]] == [3]
    assert top_hints(scores, top_n=8, min_score=0.95) == {0: (), 1: ()}


def test_request_done_inserts_the_eam_and_notifies_subscribers():
    store = EmbeddedStore()
    svc = make(store)
    sub = svc.subscribe("m", "p")
    for t in range(4):
        svc.observe(act("r1", t, done=t == 3))
    assert svc.stats().live_requests == 0 and svc.stats().requests_done == 1
    assert svc.stats().inserts_pending == 1  # insertion is off the Observe path
    assert svc.inserts.flush()
    assert store.count("m") == 1
    stats = svc.stats()
    assert stats.entries_inserted == 1 and stats.eamc_entries == 1 and stats.inserts_pending == 0
    batch = sub.get(1.0)
    assert batch.request_id == "r1" and batch.request_done and batch.hints == ()
    # The inserted EAM counts every token: 4 tokens x K experts per layer.
    from predictor_svc.eam import decode_eam

    entries, _cursor = store.load("m")
    eam, tokens = decode_eam(next(iter(entries.values())))
    assert tokens == 4 and eam.sum(axis=1).tolist() == [4 * K] * L


def test_done_without_routing_ends_the_request():
    store = EmbeddedStore()
    svc = make(store)
    svc.observe(act("r1", 0))
    assert svc.observe(Activation("r1", "m", "p", 1, [], 0, True))
    assert svc.inserts.flush() and store.count("m") == 1
    # A done for a request never seen is accepted and changes nothing.
    assert svc.observe(Activation("ghost", "m", "p", 0, [], 0, True))
    assert svc.inserts.flush() and store.count("m") == 1


def test_eamc_entries_shape_the_hints_of_a_new_request():
    svc = make(match_top_n=1)
    sub = svc.subscribe("m", "p")
    # A finished request that always used experts 6, 7 in layer 2 and 0, 1 elsewhere.
    pattern = [0, 1, 0, 1, 6, 7]
    for t in range(3):
        svc.observe(act("old", t, pattern, done=t == 2))
    assert svc.inserts.flush()
    sub.get(0.5)  # the done marker of "old"
    svc.observe(act("new", 0, pattern))
    batch = sub.get(1.0)
    eamc_top = {h.expert for h in batch.hints if h.moe_layer == 2}
    assert eamc_top == {6, 7}
    assert svc.stats().eamc_entries == 1


@pytest.mark.parametrize(
    ("activation", "message"),
    [
        (act("", 0), "Activation.request_id is empty"),
        (act("r", 0, model=""), "Activation.model_id is empty"),
        (act("r", 0, top_k=1), "Activation.top_k = 1 but model 'm' is registered with top_k=2"),
        (act("r", 0, []), "Activation.experts has 0 entries but model 'm' is registered with 3 layers"),
        (
            act("r", 0, [1, 2, 3]),
            "Activation.experts has 3 entries but model 'm' is registered with 3 layers",
        ),
        (act("r", 0, num_moe_layers=5), "Activation.num_moe_layers = 5 but model 'm' is registered with"),
        (
            act("r", 0, [0, 1, 2, 3, 4, 8]),
            "Activation.experts[5] = 8 is out of range: model 'm' has 8 experts",
        ),
        (
            act("r", 0, num_experts=1),
            "Activation.num_experts = 1 but model 'm' is registered with num_experts=8",
        ),
    ],
)
def test_bad_activation_names_the_field(activation, message):
    svc = make()
    with pytest.raises(BadActivation) as info:
        svc.observe(activation)
    assert message in str(info.value)
    assert svc.stats().live_requests == 0 and svc.stats().observed_tokens == 0


def test_shape_and_order_errors_against_known_model_and_request():
    svc = make()
    svc.observe(act("r", 3))
    with pytest.raises(
        BadActivation,
        match="Activation.experts has 4 entries but model 'm' is registered with 3 layers x top_k=2",
    ):
        svc.observe(act("r", 4, [0, 1, 2, 3]))
    with pytest.raises(
        BadActivation, match="Activation.num_experts = 16 but model 'm' is registered with num_experts=8"
    ):
        svc.observe(act("r", 4, num_experts=16))
    with pytest.raises(
        BadActivation, match="Activation.token_index = 3 does not follow the last token index 3"
    ):
        svc.observe(act("r", 3))
    svc.observe(act("r", 7, act("r", 7).experts, num_experts=0, top_k=0))  # gaps allowed; 0 = registered
    assert svc.stats().observed_tokens == 2


def test_subscribe_requires_a_model():
    with pytest.raises(BadActivation, match="SubscribeHintsRequest.model_id is empty"):
        make().subscribe("", "p")


def test_store_down_keeps_observe_working_and_retries_inserts():
    store = FlakyStore()
    svc = make(store)
    sub = svc.subscribe("m", "p")
    svc.observe(act("a", 0, done=True))
    assert svc.inserts.flush()
    store.down = True
    for t in range(3):
        svc.observe(act("b", t, done=t == 2))
    assert sub.get(1.0) is not None  # hints still flow from memory
    assert not svc.inserts.flush()
    svc.inserts.sync_now()
    stats = svc.stats()
    # one failed insert, one failed sync per configured model (m, n)
    assert stats.store_errors == 3 and stats.store_degraded and stats.inserts_pending == 1
    assert stats.eamc_entries == 1
    store.down = False
    assert svc.inserts.flush()
    stats = svc.stats()
    assert store.count("m") == 2 and stats.inserts_pending == 0 and not stats.store_degraded
    assert stats.entries_inserted == 2


def test_retry_queue_is_bounded():
    store = FlakyStore()
    store.down = True
    svc = make(store, max_pending_inserts=2)
    for r in range(3):
        svc.observe(act(f"r{r}", 0, done=True))
    stats = svc.stats()
    assert stats.inserts_pending == 2 and stats.inserts_dropped == 1


def test_quiet_requests_expire_without_insertion():
    now = [100.0]
    store = EmbeddedStore()
    svc = PredictorService(
        PredictorConfig(live_request_ttl_s=10.0, model_shapes=SHAPES),
        store,
        clock=lambda: now[0],
        background=False,
    )
    svc.observe(act("r", 0))
    now[0] += 5
    assert svc.expire() == 0
    now[0] += 6
    assert svc.expire() == 1
    assert svc.inserts.flush() and store.count("m") == 0
    assert svc.stats().requests_expired == 1 and svc.stats().live_requests == 0


def test_max_live_requests_drops_least_recently_active():
    svc = make(max_live_requests=2)
    svc.observe(act("a", 0))
    svc.observe(act("b", 0))
    svc.observe(act("a", 1))
    svc.observe(act("c", 0))  # b is the least recently active
    assert svc.stats().live_requests == 2 and svc.stats().requests_expired == 1
    svc.observe(act("b", 1))  # b starts over as a new live request
    assert svc.stats().requests_expired == 2


def test_configured_model_shape_needs_no_num_experts():
    svc = make(model_shapes=("m=3x8x2",))
    svc.observe(act("r", 0, num_experts=0))
    assert svc.stats().models[0].layers == 3


def test_an_unregistered_model_is_refused_before_anything_is_allocated():
    svc = make(model_shapes=())
    with pytest.raises(ModelNotRegistered, match="Activation.model_id 'm' is not registered"):
        svc.observe(act("r", 0, num_experts=4096, num_moe_layers=3))
    with pytest.raises(ModelNotRegistered, match="SubscribeHintsRequest.model_id 'm' is not registered"):
        svc.subscribe("m", "p")
    stats = svc.stats()
    assert stats.models == () and stats.live_requests == 0 and stats.live_bytes == 0
    assert stats.refused == {"unregistered_model": 2}
    shape, created = svc.register_model("m", L, E, K)
    assert created and (shape.layers, shape.experts, shape.top_k) == (L, E, K)
    assert svc.register_model("m", L, E, K)[1] is False  # idempotent
    svc.observe(act("r", 0))
    assert svc.stats().live_requests == 1 and svc.stats().live_bytes > 0


def test_background_thread_inserts_promptly_and_close_ends_subscriptions():
    store = EmbeddedStore()
    svc = PredictorService(PredictorConfig(sync_interval_s=3600.0, model_shapes=SHAPES), store)
    sub = svc.subscribe("m", "p")
    got: list = []
    reader = threading.Thread(target=lambda: got.append(sub.get(None)))
    svc.observe(act("r", 0, done=True))
    deadline = threading.Event()
    for _ in range(100):
        if store.count("m") == 1:
            break
        deadline.wait(0.02)
    assert store.count("m") == 1  # woken at request end, not after sync_interval_s
    sub.get(0.5)
    reader.start()
    svc.close()
    reader.join(2.0)
    assert got == [None] and sub.closed
    assert svc.stats().subscribers == 0


def test_concurrent_observers_and_a_slow_subscriber():
    svc = make()
    sub: Subscription = svc.subscribe("m", "p")  # never read

    def run(r):
        for t in range(50):
            svc.observe(act(f"r{r}", t, done=t == 49))

    run_in_threads(run, range(4), timeout_s=10)
    assert svc.stats().requests_done == 4 and svc.stats().observed_tokens == 200
    assert sub.pending_requests() == 4
    assert svc.inserts.flush() and svc.stats().eamc_entries == 4


def test_subscriber_queue_is_bounded_in_bytes_too():
    from predictor_svc.subscriptions import HINT_BYTES, LAYER_BYTES

    per_request = LAYER_BYTES + L * (LAYER_BYTES + HINT_BYTES * 2)  # 2 hints per layer (top_n 2)
    svc = make(subscriber_queue_bytes=2 * per_request + 1, hint_top_n=2)
    sub = svc.subscribe("m", "p")  # never read
    for r in range(5):
        svc.observe(act(f"r{r}", 0))
    assert sub.pending_requests() == 2 and sub.pending_bytes() <= 2 * per_request + 1
    assert svc.stats().hints_dropped == 3 * L
    assert sub.get(0.1).request_id == "r3"  # the newest two are kept, oldest first
    assert sub.pending_bytes() == per_request


def test_max_subscribers_refuses_one_more():
    from predictor_svc.errors import LimitReached

    svc = make(max_subscribers=2)
    a, _b = svc.subscribe("m", "p"), svc.subscribe("n", "p")
    with pytest.raises(LimitReached, match="2 hint subscribers are open, the limit max_subscribers=2"):
        svc.subscribe("m", "q")
    a.close()
    svc.subscribe("m", "q")  # a closed one frees its place
    assert svc.stats().refused == {"max_subscribers": 1}
