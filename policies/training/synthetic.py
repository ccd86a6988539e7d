"""Phrasing variants made by this project, to teach the classifier workloads rather than prefixes.

Two kinds: public prompts re-asked with other instructions (the same article summarized with
"TL;DR", the same German sentence asked about in other words), and short templated requests for
phrasings the public sets lack (code in other languages, creative writing, JSON extraction).
Deterministic for a given random generator.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

Variant = tuple[str, str, str]  # (text, label, group)

SUMMARIZE = [
    "TL;DR:\n\n{x}",
    "Give me a short summary of this article.\n\n{x}",
    "{x}\n\nSummarize the above in two sentences.",
    "Condense the following news story into a few bullet points:\n{x}",
    "What are the key points of this text?\n\n{x}",
    "Write a one-paragraph abstract for:\n{x}",
    "{x}\n\nCan you sum this up for me?",
]
RAG = [
    "Answer the question using only the documents below.\n\n{x}",
    "Context:\n{x}\n\nBased on the context, answer.",
    "Use the retrieved passages to answer the user's question. Cite the passage you used.\n\n{x}",
    "Here are some search results:\n{x}\n\nWhat is the answer according to these sources?",
]
TRANSLATE_DE = [
    "Translate this into English: {x}",
    "What does this German sentence mean in English? {x}",
    "Please render the following German text in English:\n{x}",
    "English translation please:\n{x}",
    "Übersetze ins Englische: {x}",
    'Can you translate "{x}" from German?',
]
TRANSLATE_EN = [
    "Translate into French: {x}",
    "How would you say this in Spanish? {x}",
    "Translate the following to Japanese:\n{x}",
    "Please translate this paragraph into Italian:\n{x}",
    "Render this text in Portuguese: {x}",
    "Convert this English sentence to Chinese: {x}",
    "Translate to German, keeping the tone: {x}",
]
QA = [
    "Quick question: {x}",
    "{x} Answer briefly.",
    "Do you know {x}",
    "I was wondering, {x}",
    "{x} Just the answer please.",
]
MATH = [
    "Solve step by step: {x}",
    "{x}\nShow your reasoning, then give the final number.",
    "Work through this word problem carefully.\n{x}",
    "{x} Let's think step by step.",
]
CODE_REWORK = [
    "Fix the bug in this function:\n```python\n{x}    return None\n```",
    "Explain what this code is supposed to do:\n{x}",
    "Write pytest unit tests for this function:\n{x}",
    "Port this Python function to JavaScript:\n```python\n{x}```",
    "Add type hints and a docstring:\n{x}",
    "Refactor this for readability:\n```\n{x}\n```",
]
LANGUAGES = [
    "Python",
    "JavaScript",
    "TypeScript",
    "Go",
    "Rust",
    "Java",
    "C++",
    "C#",
    "Ruby",
    "Bash",
    "SQL",
    "Kotlin",
]
TASKS = [
    "reverses a linked list",
    "parses a CSV file and sums the second column",
    "checks whether a string is a palindrome",
    "implements binary search over a sorted array",
    "merges two sorted lists",
    "debounces a callback",
    "reads a JSON config file with defaults",
    "computes the Levenshtein distance",
    "validates an email address",
    "implements an LRU cache",
    "finds the shortest path in a grid with BFS",
    "retries an HTTP request with backoff",
    "flattens a nested dictionary",
    "counts word frequencies in a file",
    "serializes a tree to a string",
]
CODE_ASK = [
    "Write a {lang} function that {task}.",
    "How do I write code in {lang} that {task}?",
    "Implement a {lang} class that {task}, with tests.",
    "Show me a {lang} snippet that {task}.",
    "My {lang} code that {task} throws an error. Can you write a correct version?",
    "Can you code up something in {lang} which {task}?",
]
FRAMEWORKS = [
    "Django",
    "Flask",
    "React",
    "Vue",
    "Spring Boot",
    "Rails",
    "Express",
    "pandas",
    "NumPy",
    "PyTorch",
    "Kubernetes",
    "Docker",
    "Angular",
    "FastAPI",
    "Node.js",
    "Unity",
]
SYMPTOMS = [
    "throws a TypeError on startup",
    "leaks memory after a few hours",
    "returns an empty list",
    "hangs forever",
    "crashes with a segmentation fault",
    "is ten times slower than expected",
    "fails only in production",
    "gives a KeyError",
    "cannot find the module I installed",
    "deadlocks under load",
]
CODE_DEBUG = [
    "My {fw} app {sym}. How do I fix it?",
    "Why does my {fw} code {sym}?",
    "Help me debug: my {fw} service {sym}.",
    "Our {fw} project {sym} after the upgrade. What could cause that and how do I patch it?",
    "In {fw}, what's the idiomatic way to handle errors so the app no longer {sym}?",
]
PHRASES = [
    "good morning",
    "thank you very much",
    "how much does this cost",
    "I am lost",
    "see you tomorrow",
    "the bill, please",
    "nice to meet you",
    "I don't understand",
    "happy birthday",
    "where is the bathroom",
    "can you help me",
    "I love this city",
    "what time is it",
    "I have a reservation",
]
TARGETS = [
    "Spanish",
    "French",
    "German",
    "Japanese",
    "Korean",
    "Mandarin",
    "Portuguese",
    "Russian",
    "Arabic",
    "Dutch",
    "Swedish",
    "Turkish",
    "Hindi",
    "Greek",
]
TRANSLATE_PHRASE = [
    "How do you say '{p}' in {lang}?",
    "What is '{p}' in {lang}?",
    "Can you give me the {lang} for '{p}'?",
    'What\'s the {lang} way to say "{p}"?',
    "Translate '{p}' to {lang}.",
    "How would a native {lang} speaker say '{p}'?",
]
FORMS = [
    "a poem",
    "a short story",
    "song lyrics",
    "a haiku",
    "a limerick",
    "a bedtime story",
    "a toast for a wedding",
    "a diary entry",
    "a monologue",
    "a fairy tale",
    "a motivational speech",
    "a funny tweet",
]
TOPICS = [
    "a lighthouse keeper",
    "the first snow of winter",
    "a robot learning to paint",
    "lost love",
    "a dragon who is afraid of fire",
    "city life at night",
    "a cat who rules the house",
    "the ocean",
    "friendship",
    "time travel",
    "autumn leaves",
    "a haunted library",
]
CREATIVE = [
    "Write {form} about {topic}.",
    "Compose {form} about {topic} in the style of Shakespeare.",
    "I need {form} about {topic}, something whimsical.",
    "Could you write {form} about {topic}? Make it sad.",
]
ROLEPLAY = [
    "Pretend you are {who}. Stay in character and greet me.",
    "Act as {who} and tell me about your day.",
    "You are {who}. I am a traveler who just arrived. What do you say?",
    "Let's role-play: you're {who}.",
]
WHO = [
    "a pirate captain",
    "a medieval innkeeper",
    "Sherlock Holmes",
    "a grumpy wizard",
    "a tour guide on Mars",
    "a 1920s jazz musician",
    "a detective in a noir film",
    "a friendly dragon",
]
CHAT = [
    "What's your favorite season and why?",
    "I'm bored, entertain me.",
    "Tell me something that would cheer me up.",
    "What would you do if you could fly for a day?",
    "Give me some ideas for a fun weekend.",
    "Let's just chat for a bit.",
    "What do you think makes a good friend?",
    "Describe your dream vacation.",
    "Any advice for a rainy Sunday?",
    "Brainstorm names for my new puppy.",
    "Write a persuasive essay on why cats are better than dogs.",
]
JSON_ASK = [
    "Return a JSON object with keys name, date and amount for this receipt: {x}",
    "Extract the entities from this text as JSON with fields person, place, organization: {x}",
    "Respond only with valid JSON. Classify the sentiment of: {x}",
    "Output a JSON array of the key facts in: {x}",
    'Give me this data as a JSON object matching the schema {{"title": str, "tags": [str]}}: {x}',
]


def _first_sentence(text: str, limit: int = 240) -> str:
    body = text.split(":", 1)[-1].strip()
    end = body.find(". ")
    return body[: end + 1 if 0 < end < limit else limit]


def _reask(
    rows: list[dict[str, Any]],
    label: str,
    templates: list[str],
    rng: random.Random,
    per_item: int,
    cut: Callable[[str], str] = lambda t: t,
) -> list[Variant]:
    out = []
    for row in (
        r
        for r in rows
        if r["label"] == label and r["source"].startswith(("spec_bench", "gsm8k", "humaneval"))
    ):
        for tpl in rng.sample(templates, min(per_item, len(templates))):
            out.append((tpl.format(x=cut(row["text"])), label, row["group"]))
    return out


def variants(public: list[dict[str, Any]], rng: random.Random) -> list[Variant]:
    strip = lambda t: t.split(":", 1)[-1].strip()  # noqa: E731 - drop "Summarize:" / "Translate ...:"
    out: list[Variant] = []
    out += _reask(public, "summarization", SUMMARIZE, rng, 3, strip)
    out += _reask(public, "rag", RAG, rng, 2)
    out += _reask(public, "translation", TRANSLATE_DE, rng, 3, strip)
    out += _reask(public, "qa", QA, rng, 2)
    out += _reask(public, "math_reasoning", MATH, rng, 1)
    out += _reask(public, "code", CODE_REWORK, rng, 1)
    english = [r for r in public if r["label"] == "summarization"]
    for row in english:
        for tpl in rng.sample(TRANSLATE_EN, 2):
            out.append((tpl.format(x=_first_sentence(row["text"])), "translation", "en-" + row["group"]))
    for lang, task in itertools.product(LANGUAGES, TASKS):
        out.append((rng.choice(CODE_ASK).format(lang=lang, task=task), "code", f"code-{task}"))
    for fw, sym in itertools.product(FRAMEWORKS, SYMPTOMS):
        out.append((rng.choice(CODE_DEBUG).format(fw=fw, sym=sym), "code", f"debug-{sym}"))
    for phrase, lang in itertools.product(PHRASES, TARGETS):
        out.append(
            (rng.choice(TRANSLATE_PHRASE).format(p=phrase, lang=lang), "translation", f"phrase-{phrase}")
        )
    for form, topic in itertools.product(FORMS, TOPICS):
        out.append((rng.choice(CREATIVE).format(form=form, topic=topic), "open_chat", f"creative-{topic}"))
    for tpl, who in itertools.product(ROLEPLAY, WHO):
        out.append((tpl.format(who=who), "open_chat", f"role-{who}"))
    out += [(text, "open_chat", f"chat{i}") for i, text in enumerate(CHAT)]
    for row in rng.sample([r for r in public if r["label"] in ("summarization", "qa")], 60):
        out.append(
            (rng.choice(JSON_ASK).format(x=_first_sentence(row["text"])), "tool_call", "json-" + row["group"])
        )
    return out
