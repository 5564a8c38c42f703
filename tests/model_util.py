"""Configurations of the small models the tests build: a feed-forward width of twice the hidden size."""


def small_config(config_cls, vocab, hidden, layers, heads, **more):
    """``config_cls`` (a PaddleNLP configuration class) of ``layers`` layers of width ``hidden``;
    ``more`` sets other fields (max_position_embeddings, num_labels, ...)."""
    return config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        **more,
    )
