//! The order the broker's endpoints are tried in: a round goes through
//! every endpoint once, starting at the one that last worked, or at the one
//! after the endpoint whose connection was lost (its node may be gone).

/// Where the next round of connection attempts starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    count: usize,
    start: usize,
}

impl Rotation {
    /// A rotation over `count` endpoints (at least one), starting at the first.
    pub fn new(count: usize) -> Rotation {
        Rotation {
            count: count.max(1),
            start: 0,
        }
    }

    /// The endpoints of the next round, by index, each once, in list order
    /// from the start, wrapping around.
    pub fn round(&self) -> impl Iterator<Item = usize> + use<> {
        let Rotation { count, start } = *self;
        (0..count).map(move |step| (start + step) % count)
    }

    /// Endpoint `index` connected: the next round starts there again.
    pub fn worked(&mut self, index: usize) {
        self.start = index % self.count;
    }

    /// Endpoint `index`'s connection was lost: the next round starts at the
    /// endpoint after it.
    pub fn lost(&mut self, index: usize) {
        self.start = (index + 1) % self.count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(rotation: &Rotation) -> Vec<usize> {
        rotation.round().collect()
    }

    #[test]
    fn a_round_tries_every_endpoint_once_in_order_from_where_it_starts() {
        let mut rotation = Rotation::new(3);
        assert_eq!(round(&rotation), [0, 1, 2]);
        rotation.worked(1);
        assert_eq!(
            round(&rotation),
            [1, 2, 0],
            "a failed round starts again there"
        );
        rotation.lost(1);
        assert_eq!(
            round(&rotation),
            [2, 0, 1],
            "after a loss, the next endpoint first"
        );
        rotation.lost(2);
        assert_eq!(round(&rotation), [0, 1, 2], "wraps around");
    }

    #[test]
    fn one_endpoint_is_always_the_one_tried() {
        let mut rotation = Rotation::new(1);
        rotation.lost(0);
        assert_eq!(round(&rotation), [0]);
        rotation.worked(0);
        assert_eq!(round(&rotation), [0]);
    }
}
