"""Records <-> plain JSON-able dicts, for the journal and scheduler checkpoints (no torch)."""

from __future__ import annotations

from tailrace.types import Finish, GenResult, Prompt, Trajectory


def traj_to_dict(t: Trajectory) -> dict:
    # written field by field: dataclasses.asdict deep-copies every token, ~4x slower on the driver's hot path
    r = t.result
    return {
        "group": t.group,
        "sample_index": t.sample_index,
        "prompt_id": t.prompt_id,
        "prompt_ids": list(t.prompt_ids),
        "reward": t.reward,
        "correct": t.correct,
        "dispatch_version": t.dispatch_version,
        "result": {
            "request_id": r.request_id,
            "token_ids": list(r.token_ids),
            "logprobs": list(r.logprobs),
            "versions": list(r.versions),
            "finish": r.finish.value,
            "submitted": r.submitted,
            "first_token": r.first_token,
            "finished": r.finished,
        },
    }


def traj_from_dict(d: dict) -> Trajectory:
    r = dict(d["result"])
    r["finish"] = Finish(r["finish"])
    for k in ("token_ids", "logprobs", "versions"):
        r[k] = tuple(r[k])
    return Trajectory(
        group=d["group"],
        sample_index=d["sample_index"],
        prompt_id=d["prompt_id"],
        prompt_ids=tuple(d["prompt_ids"]),
        result=GenResult(**r),
        reward=d["reward"],
        correct=d["correct"],
        dispatch_version=d["dispatch_version"],
    )


def prompt_to_dict(p: Prompt) -> dict:
    return {"id": p.id, "token_ids": list(p.token_ids), "task": p.task, "answer": p.answer, "text": p.text}


def prompt_from_dict(d: dict) -> Prompt:
    return Prompt(
        id=d["id"], token_ids=tuple(d["token_ids"]), task=d["task"], answer=d["answer"], text=d["text"]
    )
