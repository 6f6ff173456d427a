"""Helpers shared by the test files (imported as `helpers`; pytest puts tests/ on sys.path)."""
import torch


def full_forward_logprobs(model, s, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of a sample's response tokens from one plain forward pass of `model`
    over prompt + response: the reference the engines are checked against."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    P = len(s.prompt_ids)
    return logp[P - 1:-1].gather(1, torch.tensor(s.response_ids).unsqueeze(1)).squeeze(1)
