//! A list that keeps its first element inline: stream frames almost always hold one choice
//! and one tool-call delta, and a heap allocation per frame would cost more than reading it.

use serde::{Deserialize, Deserializer};

#[derive(Debug, Clone)]
pub struct Few<T> {
    first: Option<T>,
    rest: Vec<T>,
}

impl<T> Default for Few<T> {
    fn default() -> Self {
        Few { first: None, rest: Vec::new() }
    }
}

impl<T> Few<T> {
    pub fn push(&mut self, item: T) {
        if self.first.is_none() {
            self.first = Some(item);
        } else {
            self.rest.push(item);
        }
    }

    /// Append a default element and hand it back to be filled in place (the elements are
    /// large; building them where they live saves a copy each).
    pub fn push_default(&mut self) -> &mut T
    where
        T: Default,
    {
        if self.first.is_none() {
            return self.first.insert(T::default());
        }
        self.rest.push(T::default());
        let last = self.rest.len() - 1;
        &mut self.rest[last]
    }

    /// The last element pushed.
    pub fn last_mut(&mut self) -> Option<&mut T> {
        match self.rest.last_mut() {
            Some(last) => Some(last),
            None => self.first.as_mut(),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.first.iter().chain(self.rest.iter())
    }

    pub fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }
}

impl<T> IntoIterator for Few<T> {
    type Item = T;
    type IntoIter = std::iter::Chain<std::option::IntoIter<T>, std::vec::IntoIter<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.rest)
    }
}

impl<T> From<Vec<T>> for Few<T> {
    fn from(v: Vec<T>) -> Self {
        let mut few = Few::default();
        for item in v {
            few.push(item);
        }
        few
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Few<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<T>::deserialize(d).map(Few::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order() {
        for n in 0..4 {
            let few = Few::from((0..n).collect::<Vec<_>>());
            assert_eq!(few.len(), n);
            assert_eq!(few.iter().copied().collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
            assert_eq!(few.into_iter().collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
        }
    }
}
