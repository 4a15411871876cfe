//! Splitting a grid into shards, and rewriting a kernel so a shard cannot tell.
//!
//! A shard is a contiguous range of workgroups along the grid's outermost dimension
//! with more than one workgroup. The user's WGSL stays plain WebGPU code: the module
//! is rewritten in naga IR so that its entry point becomes an ordinary function,
//! called by a new entry point that adds the shard's offset to `workgroup_id` and
//! `global_invocation_id` and reports the full grid as `num_workgroups`. The offsets
//! come from a small uniform at `@group(1)`, one per dispatch, which also lets one
//! shard exceed the adapter's per-dimension workgroup limit in several dispatches.

use gpumesh_protocol::Grid;
use naga::{
    AddressSpace, Arena, BinaryOperator, Binding, Block, BuiltIn, EntryPoint, Expression, Function,
    GlobalVariable, Handle, Module, ResourceBinding, Scalar, Span, Statement, StructMember,
    SwizzleComponent, Type, TypeInner, VectorSize,
};

use crate::error::{ExecError, Result};

/// One shard: workgroups `start..start + count` along `axis` of the full grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardRange {
    pub index: u32,
    pub axis: usize,
    pub start: u32,
    pub count: u32,
}

impl ShardRange {
    /// The shard's own grid.
    pub fn grid(&self, full: Grid) -> [u32; 3] {
        let mut g = full.0;
        g[self.axis] = self.count;
        g
    }

    /// The workgroup offset of the shard's first workgroup in the full grid.
    pub fn offset(&self) -> [u32; 3] {
        let mut o = [0; 3];
        o[self.axis] = self.start;
        o
    }
}

/// The axis a grid is split into `shards` along: the outermost with more than one
/// workgroup, or where that one has fewer workgroups than shards, the outermost
/// that has as many (a grid of 4 x 3 x 2 workgroups splits into 2 along z, into 3
/// along y, into 4 along x).
pub fn split_axis(grid: Grid, shards: u32) -> usize {
    let outermost = (0..3).rev().find(|&a| grid.0[a] > 1).unwrap_or(0);
    if grid.0[outermost] >= shards {
        return outermost;
    }
    (0..3)
        .rev()
        .find(|&a| grid.0[a] >= shards)
        .unwrap_or(outermost)
}

/// Splits `grid` into `shards` contiguous ranges as equal as possible.
pub fn plan(grid: Grid, shards: u32) -> Result<Vec<ShardRange>> {
    let axis = split_axis(grid, shards);
    let total = grid.0[axis];
    if shards == 0 || shards > total {
        let most = grid.0.iter().copied().max().unwrap_or(1);
        let [x, y, z] = grid.0;
        return Err(ExecError::Task(format!(
            "cannot split a grid of {x} x {y} x {z} workgroups into {shards} shards: a \
             shard is a range along one dimension; use 1..={most} shards"
        )));
    }
    let (base, extra) = (total / shards, total % shards);
    let mut start = 0;
    Ok((0..shards)
        .map(|index| {
            let count = base + u32::from(index < extra);
            let range = ShardRange {
                index,
                axis,
                start,
                count,
            };
            start += count;
            range
        })
        .collect())
}

/// One dispatch of a shard: its size and the full-grid offsets it must see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dispatch {
    pub groups: [u32; 3],
    pub workgroup_offset: [u32; 3],
}

/// Splits a shard into dispatches of at most `max_per_dim` workgroups per dimension.
pub fn dispatches(shard: &ShardRange, full: Grid, max_per_dim: u32) -> Vec<Dispatch> {
    let grid = shard.grid(full);
    let offset = shard.offset();
    let max = max_per_dim.max(1);
    let mut out = Vec::new();
    for z in (0..grid[2]).step_by(max as usize) {
        for y in (0..grid[1]).step_by(max as usize) {
            for x in (0..grid[0]).step_by(max as usize) {
                out.push(Dispatch {
                    groups: [
                        (grid[0] - x).min(max),
                        (grid[1] - y).min(max),
                        (grid[2] - z).min(max),
                    ],
                    workgroup_offset: [offset[0] + x, offset[1] + y, offset[2] + z],
                });
            }
        }
    }
    out
}

/// Bytes of the `@group(1)` uniform a dispatch reads: workgroup offset, full grid and
/// invocation offset, each a `vec4<u32>`.
pub const SHARD_INFO_BYTES: u64 = 48;

/// The uniform contents for one dispatch.
pub fn shard_info(d: &Dispatch, full: Grid, workgroup_size: [u32; 3]) -> [u32; 12] {
    let o = d.workgroup_offset;
    let g = full.0;
    let w = workgroup_size;
    [
        o[0],
        o[1],
        o[2],
        0,
        g[0],
        g[1],
        g[2],
        0,
        o[0].wrapping_mul(w[0]),
        o[1].wrapping_mul(w[1]),
        o[2].wrapping_mul(w[2]),
        0,
    ]
}

/// Rewrites `module` so that `entry_point` sees full-grid builtins when dispatched
/// with a shard-info uniform at `@group(group) @binding(0)`. The result keeps only
/// that entry point.
pub fn instrument(module: &Module, entry_point: &str, group: u32) -> Result<Module> {
    let mut m = module.clone();
    let index = m
        .entry_points
        .iter()
        .position(|ep| ep.name == entry_point)
        .ok_or_else(|| ExecError::MissingEntryPoint {
            name: entry_point.to_string(),
            available: Vec::new(),
        })?;
    let ep = m.entry_points.swap_remove(index);
    m.entry_points.clear();

    // The user's entry point becomes a plain function with the same arguments.
    let mut user = ep.function.clone();
    for arg in &mut user.arguments {
        arg.binding = None;
    }
    user.name = Some(format!("gpumesh_user_{}", ep.name));
    let user = m.functions.append(user, Span::UNDEFINED);

    let vec4u = m.types.insert(
        Type {
            name: None,
            inner: TypeInner::Vector {
                size: VectorSize::Quad,
                scalar: Scalar::U32,
            },
        },
        Span::UNDEFINED,
    );
    let member = |name: &str, offset: u32| StructMember {
        name: Some(name.into()),
        ty: vec4u,
        binding: None,
        offset,
    };
    let info_ty = m.types.insert(
        Type {
            name: Some("GpumeshShardInfo".into()),
            inner: TypeInner::Struct {
                members: vec![
                    member("workgroup_offset", 0),
                    member("grid", 16),
                    member("invocation_offset", 32),
                ],
                span: SHARD_INFO_BYTES as u32,
            },
        },
        Span::UNDEFINED,
    );
    let info = m.global_variables.append(
        GlobalVariable {
            name: Some("gpumesh_shard".into()),
            space: AddressSpace::Uniform,
            binding: Some(ResourceBinding { group, binding: 0 }),
            ty: info_ty,
            init: None,
        },
        Span::UNDEFINED,
    );

    let mut wrapper = Function {
        name: Some(ep.name.clone()),
        arguments: ep.function.arguments.clone(),
        ..Function::default()
    };
    let mut exprs = Builder {
        arena: Arena::new(),
        info: None,
    };
    let info_ptr = exprs
        .arena
        .append(Expression::GlobalVariable(info), Span::UNDEFINED);
    let args: Vec<Handle<Expression>> = (0..wrapper.arguments.len() as u32)
        .map(|i| {
            exprs
                .arena
                .append(Expression::FunctionArgument(i), Span::UNDEFINED)
        })
        .collect();
    // Everything appended from here on needs an Emit statement.
    let first_emitted = exprs.arena.len();
    exprs.info = Some(ShardFields::load(&mut exprs.arena, info_ptr));
    let mut call_args = Vec::with_capacity(args.len());
    for (arg, decl) in args.iter().zip(&wrapper.arguments) {
        call_args.push(exprs.adjust(&m, *arg, decl.binding.as_ref(), decl.ty));
    }
    let emitted = exprs.arena.range_from(first_emitted);
    wrapper.expressions = exprs.arena;
    wrapper.body = Block::from_vec(vec![
        Statement::Emit(emitted),
        Statement::Call {
            function: user,
            arguments: call_args,
            result: None,
        },
        Statement::Return { value: None },
    ]);
    m.entry_points.push(EntryPoint {
        name: ep.name,
        stage: ep.stage,
        early_depth_test: None,
        workgroup_size: ep.workgroup_size,
        workgroup_size_overrides: None,
        function: wrapper,
    });
    Ok(m)
}

/// The three `vec3<u32>` values of the shard-info uniform, loaded once.
#[derive(Clone, Copy)]
struct ShardFields {
    workgroup_offset: Handle<Expression>,
    grid: Handle<Expression>,
    invocation_offset: Handle<Expression>,
}

impl ShardFields {
    fn load(arena: &mut Arena<Expression>, info: Handle<Expression>) -> Self {
        let mut field = |index: u32| {
            let ptr = arena.append(
                Expression::AccessIndex { base: info, index },
                Span::UNDEFINED,
            );
            let v4 = arena.append(Expression::Load { pointer: ptr }, Span::UNDEFINED);
            arena.append(
                Expression::Swizzle {
                    size: VectorSize::Tri,
                    vector: v4,
                    pattern: [
                        SwizzleComponent::X,
                        SwizzleComponent::Y,
                        SwizzleComponent::Z,
                        SwizzleComponent::W,
                    ],
                },
                Span::UNDEFINED,
            )
        };
        ShardFields {
            workgroup_offset: field(0),
            grid: field(1),
            invocation_offset: field(2),
        }
    }
}

struct Builder {
    arena: Arena<Expression>,
    info: Option<ShardFields>,
}

impl Builder {
    /// The value the user's function should receive for an argument (or struct
    /// member) carrying `binding`.
    fn adjust(
        &mut self,
        m: &Module,
        value: Handle<Expression>,
        binding: Option<&Binding>,
        ty: Handle<Type>,
    ) -> Handle<Expression> {
        let Some(info) = self.info else { return value };
        match binding {
            Some(Binding::BuiltIn(BuiltIn::GlobalInvocationId)) => {
                self.add(value, info.invocation_offset)
            }
            Some(Binding::BuiltIn(BuiltIn::WorkGroupId)) => self.add(value, info.workgroup_offset),
            Some(Binding::BuiltIn(BuiltIn::NumWorkGroups)) => info.grid,
            Some(_) => value,
            None => match &m.types[ty].inner {
                TypeInner::Struct { members, .. }
                    if members.iter().any(|mb| mb.binding.is_some()) =>
                {
                    let members = members.clone();
                    let components = members
                        .iter()
                        .enumerate()
                        .map(|(i, mb)| {
                            let part = self.arena.append(
                                Expression::AccessIndex {
                                    base: value,
                                    index: i as u32,
                                },
                                Span::UNDEFINED,
                            );
                            self.adjust(m, part, mb.binding.as_ref(), mb.ty)
                        })
                        .collect();
                    self.arena
                        .append(Expression::Compose { ty, components }, Span::UNDEFINED)
                }
                _ => value,
            },
        }
    }

    fn add(&mut self, left: Handle<Expression>, right: Handle<Expression>) -> Handle<Expression> {
        self.arena.append(
            Expression::Binary {
                op: BinaryOperator::Add,
                left,
                right,
            },
            Span::UNDEFINED,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_axis_exactly_once() {
        for total in 1..40u32 {
            for shards in 1..=total.min(9) {
                let p = plan(Grid([3, total, 1]), shards).unwrap();
                assert_eq!(p.len() as u32, shards);
                let mut next = 0;
                for r in &p {
                    assert_eq!(r.axis, if total > 1 { 1 } else { 0 });
                    assert_eq!(r.start, next);
                    assert!(r.count >= 1);
                    next += r.count;
                }
                assert_eq!(next, if total > 1 { total } else { 3 });
            }
        }
        assert!(plan(Grid([4, 1, 1]), 5).is_err());
        assert!(plan(Grid([4, 1, 1]), 0).is_err());
    }

    #[test]
    fn split_axis_is_outermost_with_more_than_one_group_and_enough() {
        assert_eq!(split_axis(Grid([8, 1, 1]), 2), 0);
        assert_eq!(split_axis(Grid([8, 2, 1]), 2), 1);
        assert_eq!(split_axis(Grid([8, 2, 3]), 3), 2);
        assert_eq!(split_axis(Grid([1, 1, 1]), 1), 0);
        // Fewer along the outermost than shards: the next that has as many.
        assert_eq!(split_axis(Grid([4, 3, 2]), 3), 1);
        assert_eq!(split_axis(Grid([4, 3, 2]), 4), 0);
        assert_eq!(split_axis(Grid([4, 3, 2]), 5), 2);
    }

    #[test]
    fn every_shard_count_up_to_the_longest_dimension_plans_and_covers_the_grid() {
        for grid in [[4, 3, 2], [2, 5, 3], [7, 1, 2], [1, 6, 1]] {
            let most = *grid.iter().max().unwrap();
            for shards in 1..=most {
                let p = plan(Grid(grid), shards).unwrap();
                assert_eq!(p.len() as u32, shards);
                let covered: u32 = p
                    .iter()
                    .map(|r| r.grid(Grid(grid)).iter().product::<u32>())
                    .sum();
                assert_eq!(covered, grid.iter().product::<u32>(), "{grid:?} {shards}");
            }
            let e = plan(Grid(grid), most + 1).unwrap_err().to_string();
            assert!(e.contains(&format!("use 1..={most} shards")), "{e}");
        }
    }

    #[test]
    fn dispatches_tile_big_shards() {
        let shard = ShardRange {
            index: 0,
            axis: 0,
            start: 10,
            count: 250,
        };
        let d = dispatches(&shard, Grid([300, 3, 1]), 100);
        let total: u64 = d
            .iter()
            .map(|d| d.groups.iter().map(|&g| u64::from(g)).product::<u64>())
            .sum();
        assert_eq!(total, 250 * 3);
        assert_eq!(d[0].workgroup_offset, [10, 0, 0]);
        assert_eq!(d[2].groups, [50, 3, 1]);
        assert_eq!(d[2].workgroup_offset, [210, 0, 0]);
    }
}
