"""The fixed prompts of the shipped models: what accuracy is measured on, by the golden tests
(tests/e2e/test_gguf_models.py) and by `foldline bench --accuracy`, so both report the same steps.

Per model, a short prompt and a long one (Gemma's crosses its 512-token window).
"""

from __future__ import annotations

LONG_TEXT = (
    "The old lighthouse keeper kept a ledger of every ship that passed the point. In spring the fishing boats "
    "came first, low in the water and loud with gulls, and after them the grain barges from the river towns. "
    "He wrote down the name of each vessel, the hour, the wind and the colour of the sea, because his father "
    "had done the same and because nobody had ever told him to stop. By the time he was sixty the ledgers "
    "filled two shelves of the tower room, and the damp had begun to curl their covers.\n\n"
    "One winter a young surveyor arrived with instructions to measure the cliff. The county planned a new road "
    "along the coast, and the engineers wanted to know how quickly the chalk was falling into the sea. The "
    "surveyor set up a brass instrument on three legs, squinted through it for a week, and grew more worried "
    "each day. His numbers did not agree with the maps. Either the cliff was retreating far faster than anyone "
    "believed, or the maps had been wrong from the beginning.\n\n"
    "The keeper listened to him complain over supper and then climbed the stairs without a word. He came back "
    "with an armful of ledgers and opened the oldest one on the table. Next to the ships, in a smaller hand, "
    "his grandfather had noted the distance from the tower to the edge of the cliff, paced out every New "
    "Year's morning for forty years. His father had continued the habit, and so had he. Nobody had asked them "
    "to; it was simply part of the job, like trimming the wick and polishing the lens.\n\n"
    "The surveyor copied the figures by lamplight until his fingers ached. When he drew them on squared paper "
    "the points made an almost straight line, bending only in the years of the great storms. The cliff had lost "
    "a little more than a metre a year for a century and a quarter. The maps were wrong because their makers "
    "had trusted an earlier map instead of walking to the edge themselves.\n\n"
    "In the spring the engineers moved the road three hundred metres inland. The surveyor sent the keeper a "
    "letter of thanks and a parcel containing a new ledger bound in oilcloth, which would not curl in the damp. "
    "The keeper wrote the first entry that same evening: a fishing boat called Margaret, the wind from the "
    "south-west, the sea grey-green, and forty-one paces from the door of the tower to the edge. Then, because "
    "it seemed right, he added a line his grandfather had never written: measured for the road, and for whoever "
    "comes after. Years later, when the lighthouse was automated and the keeper had moved to a cottage in the "
    "village, the ledgers were taken to the county archive, where students still read them to learn how the "
    "coast has changed, and how patient records can outlast the people who keep them."
)

# Prompts per shipped model, as plain text (no chat template).
PROMPTS: dict[str, list[str]] = {
    "smollm2-135m": [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        LONG_TEXT[:700],
    ],
    "gemma3-270m": [
        "The capital of France is",
        LONG_TEXT + "\n\nQuestion: how far was the tower from the edge in the new ledger? Answer:",
    ],
}
