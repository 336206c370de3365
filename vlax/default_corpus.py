"""The small embedded text the default checkpoint's byte-level BPE tokenizer is trained on.

Changing it changes the default checkpoint: bump `DEFAULT_MODEL_VERSION` in default_model.py.
"""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a prompt, one token at a
time, and predicts the token that comes next. An inference engine runs many such requests at
once: it schedules prefill chunks and decode steps into one batch, keeps the key and value cache
of every request in fixed-size blocks, and reuses blocks whose prefix it has already computed.

Once upon a time there was a little robot who lived in a library. Every morning it sorted the
books by colour, by size and by the number of pages. In the evening it read stories to the cats
that slept on the warm shelves near the window. The cats never said thank you, but they purred,
and the robot decided that purring was a kind of thank you after all.

Hello! How are you today? I am fine, thank you. What would you like to talk about? We could talk
about the weather, about cooking, about music, or about the history of mathematics. Numbers such
as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256 and 1024 appear in code and in stories alike.

def generate(prompt, max_tokens=16):
    tokens = tokenize(prompt)
    for step in range(max_tokens):
        logits = model(tokens)
        tokens.append(sample(logits[-1]))
    return detokenize(tokens)

User: Write a short poem about the sea.
Assistant: The sea is wide, the sea is deep, it sings the sailors into sleep; it keeps the moon,
it keeps the sun, and tells its secrets to no one.

Le petit déjeuner est prêt. Über den Wolken muss die Freiheit wohl grenzenlos sein. El niño
comió una manzana. Ça va très bien, merci. Добрый день, как дела? 今日はいい天気ですね。
你好，世界。 안녕하세요. Emoji also appear in text: 🙂 🚀 ✨ — and so do symbols like €, £, ° and ±.
"""
