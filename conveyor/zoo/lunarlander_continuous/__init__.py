"""Zoo entries for Gymnasium's LunarLanderContinuous-v3 (Box2D: land softly between the flags with two
continuous engine throttles). Needs ``pip install "gymnasium[box2d]"``."""
