"""What the engine's tests share: the shape of their small random models."""

# a Llama-family model small enough to build in milliseconds: 2 layers, 4 query heads over 2 KV
# heads of 8 dimensions, a 300-token vocabulary
SMALL = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
