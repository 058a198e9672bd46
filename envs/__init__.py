"""The environments (POMDP tasks), importable as ``envs.<name>``.

    envs.documents.DocumentEnv   document streams (HotpotQA, MuSiQue, synthetic)
    envs.dialogue.DialogueEnv    multi-session dialogue (LoCoMo, LongMemEval, synthetic)
    envs.core                    the shared core, MemoryEnv (reset/step); EnvConfig and the names
                                 other modules import from it are re-exported there
    envs.config                  EnvConfig, EnvConfigError
    envs.tools, envs.actions     tool schemas and argument checks; what each tool does
    envs.capacity                refuse or evict when the memory is full
    envs.attribution             hidden evidence attribution, relation-label checks
    envs.chunking, envs.views    chunks of the input; the memory views a prompt shows
    envs.prompt                  building and fitting the prompt to max_prompt_tokens
    envs.reward                  terminal reward and outcome
    envs.episode_store           the episode's AtomStore on the configured Chroma client
    envs.sanitize                defanging shown text
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
