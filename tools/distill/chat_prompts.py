"""Fixed chat prompts: a distillation set and a disjoint held-out set for benchmarks.

The distillation prompts are every (task, topic) pair below, in a fixed shuffled order; the
held-out prompts use other topics and are not among them, so a draft distilled on the first set is
measured on text it was not trained on.
"""

from __future__ import annotations

import random

TASKS = [
    "Explain {} to a curious teenager.",
    "Write a short paragraph about {}.",
    "What are three common misconceptions about {}?",
    "Give me a step-by-step introduction to {}.",
    "Summarise the history of {} in a few sentences.",
    "What are the pros and cons of {}?",
    "Write a friendly email to a colleague about {}.",
    "List five interesting facts about {}.",
]

# More phrasings (questions, creative and casual requests), so a draft does not learn the
# answer style of eight templates only. Listed after TASKS' prompts: a run with fewer prompts
# keeps its data when it is resumed with more.
MORE_TASKS = [
    "What is {}?",
    "How does {} work?",
    "Why does {} matter?",
    "Can you explain {} in simple terms?",
    "Tell me something surprising about {}.",
    "I'm new to {}. Where should I start?",
    "Write a short poem about {}.",
    "Describe {} in three sentences.",
    "What would the world be like without {}?",
    "Give me a quick quiz with three questions about {}.",
    "How would you explain {} to a five-year-old?",
    "What are the most important things to know about {}?",
    "Write a tweet about {}.",
    "What do people often get wrong about {}?",
    "Create a short story that involves {}.",
    "Compare {} with something from everyday life.",
]

TOPICS = [
    "black holes", "the French Revolution", "compound interest", "machine learning",
    "the water cycle", "volcanoes", "the Roman Empire", "rivers and deltas", "electric cars",
    "the human immune system", "bees and pollination", "the stock market", "jazz music",
    "renewable energy", "the printing press", "plate tectonics", "sleep and memory",
    "the internet", "coral reefs", "ancient Egypt", "quantum computing", "the Olympic Games",
    "coffee", "recycling", "the moon landing", "dinosaurs", "public libraries", "chess",
    "the Great Wall of China", "antibiotics", "cloud computing", "meditation",
    "the Renaissance", "honeybees in winter", "solar panels", "the Amazon rainforest",
    "credit cards", "sourdough bread", "the periodic table", "team sports", "minimalism",
    "the Silk Road", "3D printing", "earthquakes", "urban gardening", "the piano",
    "Mars exploration", "vaccines and herd immunity", "origami", "the Byzantine Empire",
    "submarines", "cheese making", "the Industrial Revolution", "wind turbines", "octopuses",
    "the Cold War", "blockchain", "marathon running", "tsunamis", "the human heart",
    "penguins", "the Mongol Empire", "opera", "nuclear fusion", "desert ecosystems",
    "smartphones", "photography", "volunteering", "the Aztecs", "video games",
    "rock climbing", "the Nile river", "electric guitars", "yoga", "robotics",
    "the Black Death", "hurricanes", "composting", "the Vikings", "telescopes", "board games",
    "wolves", "cryptography", "pottery", "mushrooms", "skyscrapers", "public speaking",
    "bridges", "bird migration", "DNA", "ocean tides", "glassblowing", "the Ottoman Empire",
    "glaciers", "spices", "the metric system",
]  # fmt: skip

# A third group (new phrasings over the old topics and some new ones), listed after the first
# two for the same reason. None of it touches the held-out prompts' subjects.
EXTRA_TASKS = [
    "Write a short dialogue between two friends discussing {}.",
    "What questions would an expert ask about {}?",
    "Explain the basics of {} in plain English.",
    "What is a common myth about {}, and what is the truth?",
    "Give me a beginner's guide to {}.",
    "What are the biggest challenges related to {} today?",
    "Write a product description inspired by {}.",
    "How has {} changed over the last hundred years?",
    "What careers are connected to {}?",
    "Write a motivational message that mentions {}.",
    "Explain {} using an analogy.",
    "What should a student remember about {} for an exam?",
    "Write a limerick about {}.",
    "What are some fun activities related to {}?",
    "Describe a typical day for someone who works with {}.",
    "What books or films would you recommend about {}?",
]

EXTRA_TOPICS = [
    "lighthouses", "the Arctic", "steam trains", "kites", "earthworms", "the violin",
    "the Inca Empire", "hot air balloons", "tea ceremonies in Japan", "sharks", "maps",
    "the alphabet", "clocks", "fireworks", "the Sahara", "windmills", "beekeeping",
    "the Eiffel Tower", "jellyfish", "sign language", "snowflakes", "castles", "typewriters",
    "elephants",
]  # fmt: skip

HELD_OUT = [
    "What is the capital of France, and what is it famous for?",
    "How do I make a good cup of tea?",
    "Write a haiku about the sea, then explain it.",
    "Why is the sky blue?",
    "Give me three tips for learning to code.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "What should I pack for a weekend hiking trip?",
    "Explain how a refrigerator keeps food cold.",
    "What is the difference between weather and climate?",
    "Describe how to plant a tomato seedling.",
    "How do airplanes fly?",
    "What are good habits for staying healthy while working from home?",
    "Tell me about the life of Marie Curie.",
    "How do I write a good cover letter?",
]


def distill_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """The first ``n`` of the (task, topic) prompts in a fixed order (all when None): every
    TASKS prompt, shuffled, then every MORE_TASKS prompt, shuffled, then every EXTRA_TASKS
    prompt over TOPICS and EXTRA_TOPICS, shuffled."""
    groups = ((TASKS, TOPICS), (MORE_TASKS, TOPICS), (EXTRA_TASKS, TOPICS + EXTRA_TOPICS))
    prompts = []
    for i, (tasks, topics) in enumerate(groups):
        group = [task.format(topic) for topic in topics for task in tasks]
        random.Random(seed + i).shuffle(group)
        prompts += group
    return prompts if n is None else prompts[:n]


def held_out_prompts(n: int | None = None) -> list[str]:
    return HELD_OUT if n is None else HELD_OUT[:n]
