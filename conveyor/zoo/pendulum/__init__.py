"""Zoo entries for Gymnasium's Pendulum-v1 (swing up and balance; one continuous torque in [-2, 2])."""
