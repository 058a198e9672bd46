"""The environments (POMDP tasks), importable as ``envs.<name>``.

    envs.documents.DocumentEnv   document streams (HotpotQA, MuSiQue, synthetic)
    envs.dialogue.DialogueEnv    multi-session dialogue (LoCoMo, LongMemEval, synthetic)
    envs.core                    the shared core (config, tools, prompt assembly, reward)
    envs.parser, envs.tokens     tool-call parsing, prompt token counting
"""


def make_env(task, **config):
    """The environment for a task's kind (documents or dialogue)."""
    from atommem_rl.tasks.schema import Task

    if isinstance(task, dict):
        task = Task.from_dict(task)
    if task.kind == "dialogue":
        from .dialogue import DialogueEnv

        return DialogueEnv(task, **config)
    from .documents import DocumentEnv

    return DocumentEnv(task, **config)
