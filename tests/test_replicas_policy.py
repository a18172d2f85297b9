"""The routing policy of `--replicas` (tf_async/serving/policy.py) and the conversation
keys it is given (affinity.py): pure objects, no processes."""

from __future__ import annotations

from tf_async.serving.affinity import chat_keys, completion_keys, responses_keys
from tf_async.serving.policy import RoutingPolicy


def policy_with(num_replicas: int, margin: int = 2) -> RoutingPolicy:
    policy = RoutingPolicy(num_replicas, affinity_margin=margin)
    for replica in range(num_replicas):
        policy.mark_up(replica)
    return policy


def test_nothing_up_chooses_none() -> None:
    policy = RoutingPolicy(2)
    assert policy.choose() is None
    policy.mark_up(1)
    assert policy.choose() == 1


def test_least_loaded_with_ties_to_the_lowest_index() -> None:
    policy = policy_with(3)
    assert policy.choose() == 0
    policy.begin(0)
    assert policy.choose() == 1
    policy.begin(1)
    assert policy.choose() == 2
    policy.begin(2)
    assert policy.choose() == 0
    policy.end(1)
    assert policy.choose() == 1


def test_spreads_a_burst_evenly() -> None:
    policy = policy_with(2)
    chosen = []
    for _ in range(8):
        replica = policy.choose()
        assert replica is not None
        policy.begin(replica)
        chosen.append(replica)
    assert chosen.count(0) == chosen.count(1) == 4


def test_polled_stats_break_ties_of_the_live_count() -> None:
    policy = policy_with(3)
    policy.update_stats(0, lanes_busy=3, lanes_free=1, queued=2)  # busy from elsewhere
    policy.update_stats(1, lanes_busy=1, lanes_free=3, queued=0)
    policy.update_stats(2, lanes_busy=0, lanes_free=4, queued=0)
    assert policy.choose() == 2  # most free lanes, nothing queued
    policy.begin(2)
    assert policy.choose() == 1
    policy.begin(1)
    assert policy.choose() == 0  # the live count comes first: a poll lags
    policy.begin(0)
    policy.update_stats(0, lanes_busy=0, lanes_free=4, queued=0)
    assert policy.choose() == 0


def test_down_replica_leaves_routing_and_forgets_its_stats() -> None:
    policy = policy_with(2)
    policy.update_stats(1, lanes_busy=0, lanes_free=4, queued=0)
    policy.mark_down(0)
    assert policy.choose() == 1 and policy.num_up == 1
    policy.mark_down(1)
    assert policy.choose() is None
    assert policy.replicas[1].lanes_free == 0


def test_affinity_keeps_a_conversation_on_its_replica_within_the_margin() -> None:
    policy = policy_with(2, margin=2)
    policy.remember(42, 1)
    policy.begin(1)
    policy.begin(1)  # 1 is 2 busier than 0: still within the margin
    assert policy.choose((42,)) == 1
    assert policy.num_affinity_hits == 1
    policy.begin(1)  # 3 busier: the least loaded wins
    assert policy.choose((42,)) == 0
    assert policy.num_affinity_overrides == 1


def test_affinity_to_a_down_replica_goes_to_the_least_loaded() -> None:
    policy = policy_with(3)
    policy.remember(7, 2)
    policy.mark_down(2)
    assert policy.choose((7,)) == 0


def test_longest_remembered_prefix_wins_and_unknown_keys_are_skipped() -> None:
    policy = policy_with(3)
    policy.remember(10, 1)
    policy.remember(20, 2)
    assert policy.choose((99, 20, 10)) == 2
    assert policy.choose((99, 98)) == 0


def test_remembered_keys_are_bounded_least_recently_used_first() -> None:
    policy = RoutingPolicy(2, max_keys=2)
    policy.remember(1, 0)
    policy.remember(2, 1)
    policy.remember(1, 1)  # refreshed
    policy.remember(3, 0)
    assert policy.home_of(2) is None
    assert policy.home_of(1) == 1 and policy.home_of(3) == 0


def chat(*messages: tuple[str, str], model: str = "m", salt: str | None = None) -> dict:
    return {"model": model, "cache_salt": salt,
            "messages": [{"role": role, "content": text} for role, text in messages]}


def test_turn_two_looks_up_the_key_turn_one_remembered() -> None:
    turn1 = chat(("system", "Be brief."), ("user", "Hi"))
    turn2 = chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                 ("user", "How are you?"))
    (remembered,) = chat_keys(turn1).remember
    assert remembered in chat_keys(turn2).lookup
    assert chat_keys(turn2).lookup[0] != remembered  # longest prefix first: with the reply


def test_chats_sharing_only_a_system_prompt_share_no_key() -> None:
    one = chat(("system", "S"), ("user", "a"))
    two = chat(("system", "S"), ("user", "b"))
    assert not set(chat_keys(one).remember) & set(chat_keys(two).lookup)


def test_model_and_cache_salt_are_part_of_the_key() -> None:
    turn1 = chat(("user", "Hi"))
    turn2 = [("user", "Hi"), ("assistant", "Yo"), ("user", "More")]
    (key,) = chat_keys(turn1).remember
    assert key in chat_keys(chat(*turn2)).lookup
    assert key not in chat_keys(chat(*turn2, salt="tenant-b")).lookup
    assert key not in chat_keys(chat(*turn2, model="other")).lookup


def test_completion_key_is_the_prompts_first_1024_characters() -> None:
    base = "x" * 1024
    assert completion_keys({"prompt": base + "a"}).lookup == completion_keys(
        {"prompt": base + "b"}).lookup
    assert completion_keys({"prompt": "a"}).lookup != completion_keys({"prompt": "b"}).lookup
    assert completion_keys({"prompt": [1, 2, 3]}).lookup == ()


def test_responses_input_is_keyed_like_a_chat() -> None:
    turn1 = responses_keys({"model": "m", "input": "Hi"})
    turn2 = responses_keys({"model": "m", "input": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "More"}]})
    assert turn1.remember[0] in turn2.lookup


def test_malformed_bodies_have_no_keys() -> None:
    assert chat_keys({"messages": "nope"}).lookup == ()
    assert chat_keys({}).remember == ()


def test_children_get_every_serve_flag_but_the_fronts_own() -> None:
    from tf_async.server.cli import serve_parser
    from tf_async.serving.cli import child_flags

    args = serve_parser().parse_args(
        ["--model", "m.gguf", "--parallel", "8", "--no-paging", "--served-model-name", "a", "b",
         "--replicas", "2", "--api-key", "secret", "--host", "0.0.0.0", "--port", "9000"])
    flags = child_flags(args)
    assert flags[:4] == ("--host", "127.0.0.1", "--port", "0")
    text = " ".join(flags)
    assert "--model m.gguf" in text and "--parallel 8" in text and "--no-paging" in text
    assert "--served-model-name a b" in text and "--prefix-cache" in text
    assert "secret" not in text and "--replicas" not in text and "9000" not in text
    assert serve_parser().parse_args(list(flags)).parallel == 8  # a child parses them back


def test_replica_env_splits_cores_and_gpus() -> None:
    from tf_async.serving.supervisor import replica_env

    assert dict(replica_env(1, 2, "cpu", 16)) == {"NUMBA_NUM_THREADS": "8"}
    assert dict(replica_env(1, 4, "cuda", 2)) == {"NUMBA_NUM_THREADS": "1",
                                                  "CUDA_VISIBLE_DEVICES": "1"}
    # --tensor-parallel 2: replica 1 of 2 takes GPUs 2 and 3
    assert dict(replica_env(1, 2, "cuda", 8, 2))["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_replicas_below_one_is_refused(capsys) -> None:
    from tf_async.cli import main

    assert main(["serve", "--replicas", "0", "--port", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
