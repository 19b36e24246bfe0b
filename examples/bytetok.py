"""A byte-level tokenizer: a text's UTF-8 bytes are its token ids, 256 its end.

Nothing to download or train, and no import: the OpenAI routes load it in
each HTTP worker, which never imports the model (tinygpt.py). Its chat
template writes each message as "role: content" on a line of its own, then
"assistant:" for the answer.
"""


class ByteTokenizer:
    eos_token_id = 256
    vocab_size = 257  # ids 0..256: the OpenAI routes refuse a prompt of others

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        # a sequence cut mid-character decodes to U+FFFD, as byte-level BPE's does
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text += "assistant:" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text
