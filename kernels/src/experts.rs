//! Expert parallelism's token exchange: where a mixture of experts' routed rows go, and the local
//! halves of [`FusedOps::expert_dispatch`](crate::FusedOps::expert_dispatch) and
//! [`FusedOps::expert_combine`](crate::FusedOps::expert_combine).
//!
//! A rank sorts its routed rows by expert (`counts[e]` rows for expert `e`, experts in order).
//! The `E` experts are split over the `m` members of the expert axis in contiguous runs: member
//! `j` holds experts `j·E/m .. (j+1)·E/m`. Dispatch sends each member the rows of its experts
//! (an all-to-all with variable splits) and lays the received rows out as one batch
//! `[E/m, capacity, d]`: per local expert, the rows of member 0, then member 1, …, then zero
//! rows up to the capacity (the most rows any expert of the axis receives) — the GShard layout,
//! which lets the experts run as one batched matmul over stacked weights. Combine is its
//! adjoint: the rows back from the slots, home over the all-to-all with the splits swapped.
//!
//! Without expert parallelism (`m = 1`) nothing travels: dispatch only pads the sorted rows into
//! the batch and combine takes them out.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Shape, Tensor, TensorData, TensorMetadata};

/// Where one batch of routed rows goes over the expert axis, known to every member alike (the
/// counts are gathered over the axis before dispatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRoute {
    /// Members of the expert axis (1 without expert parallelism).
    pub members: usize,
    /// This rank's index on the expert axis.
    pub index: usize,
    /// Experts in all, a multiple of `members`.
    pub experts: usize,
    /// `counts[i · experts + e]`: the rows member `i` routes to expert `e`.
    pub counts: Vec<usize>,
    /// Rows per expert in the dispatched batch: the most any expert receives, at least 1.
    pub capacity: usize,
}

impl ExpertRoute {
    /// The route of `counts` (every member's, member-major) over `members` members, this rank
    /// at `index`.
    ///
    /// # Panics
    /// When `experts` is not a multiple of `members` or `counts` does not hold
    /// `members · experts` entries (the model checks both before routing).
    pub fn new(members: usize, index: usize, experts: usize, counts: Vec<usize>) -> Self {
        assert!(
            members > 0 && experts.is_multiple_of(members) && index < members,
            "{experts} experts over {members} members (index {index})"
        );
        assert_eq!(
            counts.len(),
            members * experts,
            "one count per member and expert"
        );
        let capacity = (0..experts)
            .map(|e| (0..members).map(|i| counts[i * experts + e]).sum::<usize>())
            .max()
            .unwrap_or(0)
            .max(1);
        Self {
            members,
            index,
            experts,
            counts,
            capacity,
        }
    }

    /// Experts each member holds.
    pub fn local(&self) -> usize {
        self.experts / self.members
    }

    /// The experts member `j` holds.
    pub fn held(&self, j: usize) -> std::ops::Range<usize> {
        j * self.local()..(j + 1) * self.local()
    }

    /// Rows this rank sends each member (its rows for that member's experts).
    pub fn send(&self) -> Vec<usize> {
        let mine = &self.counts[self.index * self.experts..][..self.experts];
        (0..self.members)
            .map(|j| self.held(j).map(|e| mine[e]).sum())
            .collect()
    }

    /// Rows this rank receives from each member (that member's rows for this rank's experts).
    pub fn recv(&self) -> Vec<usize> {
        (0..self.members)
            .map(|i| {
                self.held(self.index)
                    .map(|e| self.counts[i * self.experts + e])
                    .sum()
            })
            .collect()
    }

    /// Rows this rank sends in all (the rows it routed and kept).
    pub fn sent_rows(&self) -> usize {
        self.send().iter().sum()
    }

    /// Rows this rank receives in all.
    pub fn received_rows(&self) -> usize {
        self.recv().iter().sum()
    }

    /// The dispatched batch's slot (`local expert · capacity + position`) of each received row,
    /// in received order (member, then local expert, then row).
    pub fn row_slots(&self) -> Vec<usize> {
        let mut filled = vec![0usize; self.local()];
        let mut slots = Vec::with_capacity(self.received_rows());
        for i in 0..self.members {
            for (l, e) in self.held(self.index).enumerate() {
                for _ in 0..self.counts[i * self.experts + e] {
                    slots.push(l * self.capacity + filled[l]);
                    filled[l] += 1;
                }
            }
        }
        slots
    }

    /// For each slot of the dispatched batch, the received row it holds, or the row past the
    /// received ones (a zero row) for padding.
    fn slot_rows(&self) -> Vec<usize> {
        let received = self.received_rows();
        let mut rows = vec![received; self.local() * self.capacity];
        for (r, s) in self.row_slots().into_iter().enumerate() {
            rows[s] = r;
        }
        rows
    }
}

fn indices<B: Backend>(v: Vec<usize>, device: &B::Device) -> burn::tensor::ops::IntTensor<B> {
    let n = v.len();
    let v: Vec<i64> = v.into_iter().map(|i| i as i64).collect();
    Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), device).into_primitive()
}

/// The received rows `[rows, d]` (in received order) laid out as the dispatched batch
/// `[local, capacity, d]`, padding zero.
pub fn pad<B: Backend>(received: FloatTensor<B>, route: &ExpertRoute) -> FloatTensor<B> {
    let shape = received.shape();
    let d = shape[1];
    let device = B::float_device(&received);
    let zero = B::float_zeros(Shape::new([1, d]), &device, received.dtype().into());
    let rows = if shape[0] == 0 {
        // Nothing received: every slot is padding.
        zero
    } else {
        B::float_cat(vec![received, zero], 0)
    };
    let batch = B::float_select(rows, 0, indices::<B>(route.slot_rows(), &device));
    B::float_reshape(batch, Shape::new([route.local(), route.capacity, d]))
}

/// The adjoint of [`pad`]: the received rows `[rows, d]` back out of a batch
/// `[local, capacity, d]` (padding dropped).
pub fn unpad<B: Backend>(batch: FloatTensor<B>, route: &ExpertRoute) -> FloatTensor<B> {
    let d = batch.shape()[2];
    let device = B::float_device(&batch);
    let flat = B::float_reshape(batch, Shape::new([route.local() * route.capacity, d]));
    B::float_select(flat, 0, indices::<B>(route.row_slots(), &device))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two members, four experts: member 0 routes (1, 2 | 0, 3) rows, member 1 (2, 0 | 1, 1).
    fn route(index: usize) -> ExpertRoute {
        ExpertRoute::new(2, index, 4, vec![1, 2, 0, 3, 2, 0, 1, 1])
    }

    #[test]
    fn splits_follow_the_counts() {
        let (a, b) = (route(0), route(1));
        assert_eq!(a.send(), vec![3, 3]);
        assert_eq!(b.send(), vec![2, 2]);
        // Member i's send[j] is member j's recv[i].
        assert_eq!(a.recv(), vec![3, 2]);
        assert_eq!(b.recv(), vec![3, 2]);
        // Expert 3 receives 3 + 1 rows: the most.
        assert_eq!(a.capacity, 4);
        // Member 0 receives for expert 0: 1 (from 0), 2 (from 1); expert 1: 2, 0.
        assert_eq!(a.row_slots(), vec![0, 4, 5, 1, 2]);
        assert_eq!(b.row_slots(), vec![4, 5, 6, 0, 7]);
    }

    #[test]
    fn unpad_undoes_pad() {
        use burn::backend::Flex;
        let r = route(1);
        let n = r.received_rows();
        let device = Default::default();
        let rows: Vec<f32> = (0..n * 2).map(|v| v as f32 + 1.0).collect();
        let x = Tensor::<Flex, 2>::from_data(TensorData::new(rows.clone(), [n, 2]), &device);
        let batch = pad::<Flex>(x.into_primitive().tensor(), &r);
        assert_eq!(batch.shape().to_vec(), vec![2, 4, 2]);
        let b = Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(batch));
        let values = b.clone().into_data().into_vec::<f32>().unwrap();
        // Expert 2 (local 0): member 1's one row, then three padding slots.
        assert_eq!(&values[..8], &[7.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        // Expert 3 (local 1): member 0's three rows, then member 1's one.
        assert_eq!(&values[8..16], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0, 10.0]);
        let back = unpad::<Flex>(b.into_primitive().tensor(), &r);
        let back = Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(back));
        assert_eq!(back.into_data().into_vec::<f32>().unwrap(), rows);
    }
}
