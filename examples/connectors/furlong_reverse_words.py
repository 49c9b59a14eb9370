"""reverse-words: a small verifiers taskset that runs locally (no data download, no network).

A verifiers environment written the way verifiers documents it (`verifiers.v1`): task
data, a task with its rubric (`@vf.reward`), a taskset config, the taskset, and an env
that drives the conversation. It runs in the verifiers virtual environment, never in
furlong's; furlong names it by its taskset id, `furlong-reverse-words` (this module,
found through `envs.connector.paths`).

Each task is a word. Turn 1: "Reverse the letters of the word: apple" (answer "elppa").
With `turns: 2` (the default) a scripted user then asks for the answer backwards again
(answer "apple"), so an episode is a two-turn conversation whose history the harness
sends back to the model. The reward is the mean over turns of difflib's similarity
ratio between the reply (stripped) and that turn's answer: graded, so even a tiny random
model gets rewards that differ between samples.
"""

import difflib

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "lemon", "zebra", "candle", "garden"]
FOLLOW_UP = "Now write your answer backwards, to get the original word again."


def similarity(reply: str, answer: str) -> float:
    return difflib.SequenceMatcher(None, reply.strip(), answer).ratio()


def answers(word: str, turns: int) -> list[str]:
    return [word[::-1], word][:turns]


class ReverseWordsData(vf.TaskData):
    word: str
    turns: int


class ReverseWordsTask(vf.Task[ReverseWordsData]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        expected = answers(self.data.word, self.data.turns)
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(similarity(r, a) for r, a in zip(replies, expected)) / len(expected)


class ReverseWordsConfig(vf.TasksetConfig):
    num_tasks: int = 8
    turns: int = 2


class ReverseWordsEnv(vf.SingleAgentEnv):
    """The task's prompt opens; then the scripted user sends the follow-up (turns - 1 times)."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            if (await interaction.turn()).terminated:
                return
            for _ in range(task.data.turns - 1):
                if (await interaction.turn(FOLLOW_UP)).terminated:
                    return


class ReverseWordsTaskset(vf.Taskset[ReverseWordsTask, ReverseWordsConfig]):
    def load(self):
        if self.config.turns not in (1, 2):
            raise ValueError(f"turns must be 1 or 2, got {self.config.turns}")
        for i in range(self.config.num_tasks):
            word = WORDS[i % len(WORDS)]
            data = ReverseWordsData(
                id=f"reverse-{i}", prompt=f"Reverse the letters of the word: {word}", word=word, turns=self.config.turns
            )
            yield ReverseWordsTask(data, self.config.task)


__all__ = ["ReverseWordsEnv", "ReverseWordsTaskset"]
