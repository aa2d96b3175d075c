"""Linearised softmax attention, the distillation students' layers (LoLCATs, Liger): what they
share (:mod:`.base`: the teacher's projections, an exact window with sinks, Hedgehog feature
maps, the mix), and the two recurrent branches for what leaves the window: GLA (:mod:`.gla`,
``G`` with ``linear_window``) and the gated delta rule (:mod:`.delta`, ``D`` and ``K``)."""
