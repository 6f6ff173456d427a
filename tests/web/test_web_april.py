"""APRIL's rules of thumb on the launch form: context beside its fields, as a person reads it."""


def test_the_launch_form_states_aprils_rules_of_thumb(alice):
    form = alice.get("/").content.decode()
    assert 'id="note-april"' in form
    note = form.split('id="note-april">', 1)[1].split("</p>", 1)[0]
    assert "over_sampling_batch_size at 1.5-2x rollout.rollout_batch_size" in note
    assert "segment_max_tokens first at half of the longest response" in note
    assert "a longer one gets its last chance" in note
