"""The benchmark workload: the same chat prompts and sampling for every system.

Each request is one chat-templated question; every request generates exactly ``max_new_tokens``
tokens (EOS ignored), sampled at temperature 1 with no truncation, so all systems do the same
amount of work. Concurrency ``c`` means ``c`` requests submitted at once, timed from submission
until the last one finished (prefill included).
"""

from __future__ import annotations

from dataclasses import dataclass

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.", "How do vaccines work?", "Give three tips for learning to code.",
    "Why is the sky blue?", "Summarise the plot of Hamlet.", "What is a prime number?",
    "Describe a cat to someone who has never seen one.", "How does a refrigerator keep food cold?",
    "What causes earthquakes?", "Write a short poem about autumn leaves.", "What is machine learning?",
    "How do I make a cup of tea?", "Name the planets of the solar system.", "What is the Pythagorean theorem?",
    "Why do we dream?", "Explain what a database index is.", "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.", "How does the internet work?", "What is inflation?",
    "Describe the water cycle.", "Why is exercise good for you?", "How do airplanes fly?",
    "What is a black hole?", "Give a recipe for pancakes.", "What is democracy?",
    "Explain recursion to a child.", "What are the primary colours?", "How do bees make honey?",
    "What is the speed of light?",
]


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]  # token ids, one per request slot (cycled when concurrency exceeds them)
    max_new_tokens: int
    temperature: float = 1.0

    def batch(self, concurrency: int) -> list[list[int]]:
        return [self.prompts[i % len(self.prompts)] for i in range(concurrency)]


def build_workload(tokenizer, max_new_tokens: int) -> Workload:
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return Workload(prompts=prompts, max_new_tokens=max_new_tokens)
