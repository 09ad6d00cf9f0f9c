"""Between two vocabularies: byte tables of both tokenizers, reverse translation of committed text,
drafted blocks into target tokens, the online n-gram cache, token healing."""
